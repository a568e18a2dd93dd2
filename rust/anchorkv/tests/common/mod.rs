//! Test data and the float64 reference: RoPE (NeoX) and exact attention.
#![allow(dead_code)]

use anchorkv::{Bf16, Element};

/// splitmix64 + Box-Muller: deterministic Gaussian data without crates.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn gaussian(&mut self) -> f64 {
        (-2.0 * self.uniform().ln()).sqrt() * (2.0 * std::f64::consts::PI * self.uniform()).cos()
    }
    /// n Gaussian values rounded to bf16, so a bf16 cache holds them exactly.
    pub fn bf16_exact(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| bf16_round(self.gaussian() as f32)).collect()
    }
}

pub fn bf16_round(x: f32) -> f32 {
    Bf16::from_f32(x).to_f32()
}

/// NeoX rotate-half RoPE, base 10000, of x [heads][tokens][d] at `positions` [tokens].
pub fn rope(x: &[f32], heads: usize, tokens: usize, d: usize, positions: &[f64]) -> Vec<f64> {
    let half = d / 2;
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for h in 0..heads {
        for (t, &position) in positions.iter().enumerate().take(tokens) {
            let row = &mut out[(h * tokens + t) * d..(h * tokens + t + 1) * d];
            for i in 0..half {
                let angle = position * 10000f64.powf(-2.0 * i as f64 / d as f64);
                let (a, b) = (row[i], row[i + half]);
                row[i] = a * angle.cos() - b * angle.sin();
                row[i + half] = b * angle.cos() + a * angle.sin();
            }
        }
    }
    out
}

pub struct Dims {
    pub kv_heads: usize,
    pub q_heads: usize,
    pub tokens: usize,
    pub d: usize,
    pub q_len: usize,
}

/// Exact attention: q [Hq][q_len][D], keys (post-RoPE) and values [H][T][D]; query i sees
/// rows 0..T-q_len+i; query head j reads KV head j / (Hq/H).
pub fn attention(q: &[f64], k: &[f64], v: &[f64], dims: &Dims) -> Vec<f64> {
    attention_with_penalty(q, k, v, dims, &[])
}

/// `attention` with each logit lowered by `penalty[h][t]` |scale q|^2 (`Cache::logit_penalty`;
/// empty: none).
pub fn attention_with_penalty(q: &[f64], k: &[f64], v: &[f64], dims: &Dims, penalty: &[f32]) -> Vec<f64> {
    let Dims { kv_heads, q_heads, tokens, d, q_len } = *dims;
    let group = q_heads / kv_heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; q_heads * q_len * d];
    for qh in 0..q_heads {
        let h = qh / group;
        for i in 0..q_len {
            let query = &q[(qh * q_len + i) * d..][..d];
            let visible = tokens - q_len + i + 1;
            let q2 = scale * scale * query.iter().map(|x| x * x).sum::<f64>();
            let logits: Vec<f64> = (0..visible)
                .map(|t| {
                    let dot = scale * query.iter().zip(&k[(h * tokens + t) * d..][..d]).map(|(a, b)| a * b).sum::<f64>();
                    dot - penalty.get(h * tokens + t).map_or(0.0, |&p| p as f64 * q2)
                })
                .collect();
            let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let total: f64 = weights.iter().sum();
            let o = &mut out[(qh * q_len + i) * d..][..d];
            for (t, w) in weights.iter().enumerate() {
                for (dim, value) in o.iter_mut().enumerate() {
                    *value += w / total * v[(h * tokens + t) * d + dim];
                }
            }
        }
    }
    out
}

pub fn to_f64<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|v| v.to_f32() as f64).collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (*x as f64 - y).abs()).fold(0.0, f64::max)
}
