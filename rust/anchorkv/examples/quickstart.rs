//! Compress one layer's KV cache ~10x, decode a new token, compare with exact attention.
//! Run: ANCHORKV_LIB_DIR=... cargo run --example quickstart
use anchorkv::{CompressOptions, Context, Prefill, Shape};

const H: usize = 2; // KV heads
const HQ: usize = 4; // query heads
const S: usize = 1024; // prompt positions
const D: usize = 64; // head dim
const W: usize = 32; // observation window

struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn gaussian(&mut self) -> f64 {
        (-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }
}

/// NeoX RoPE (base 10000) of one row at `position`: what the model applied to its keys.
fn rope(row: &[f32], position: usize) -> Vec<f64> {
    let half = D / 2;
    let mut out: Vec<f64> = row.iter().map(|&x| x as f64).collect();
    for i in 0..half {
        let angle = position as f64 * 10000f64.powf(-(i as f64) / half as f64);
        let (a, b) = (out[i], out[i + half]);
        out[i] = a * angle.cos() - b * angle.sin();
        out[i + half] = b * angle.cos() + a * angle.sin();
    }
    out
}

fn main() -> anchorkv::Result<()> {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    // Keys drift smoothly over 8 directions per head; values are noise.
    let basis: Vec<f64> = (0..H * 8 * D).map(|_| rng.gaussian()).collect();
    let mut keys = vec![0f32; H * S * D];
    for h in 0..H {
        let mut walk = [0f64; 8];
        for t in 0..S {
            walk.iter_mut().for_each(|w| *w += rng.gaussian() / (S as f64).sqrt());
            for d in 0..D {
                let drift: f64 = (0..8).map(|r| walk[r] * basis[(h * 8 + r) * D + d]).sum();
                keys[(h * S + t) * D + d] = (drift + 0.3 * rng.gaussian()) as f32;
            }
        }
    }
    let values: Vec<f32> = (0..H * S * D).map(|_| rng.gaussian() as f32).collect();
    let rotated: Vec<Vec<f64>> = (0..H * S).map(|row| rope(&keys[row * D..(row + 1) * D], row % S)).collect();

    // Each query head keeps coming back to 4 "topic" tokens: in the window and afterwards.
    let topics: Vec<usize> = (0..HQ * 4).map(|_| (rng.uniform() * (S - W) as f64) as usize).collect();
    let query_row = |j: usize, rng: &mut Rng| -> Vec<f32> {
        let topic = topics[j * 4 + (rng.uniform() * 4.0) as usize];
        let key = &rotated[(j / (HQ / H)) * S + topic];
        let norm = key.iter().map(|x| x * x).sum::<f64>().sqrt();
        key.iter().map(|x| (3.0 * x / norm * (D as f64).powf(0.25) + 0.5 * rng.gaussian()) as f32).collect()
    };
    let window: Vec<f32> = (0..HQ).flat_map(|j| (0..W).flat_map(|_| query_row(j, &mut rng)).collect::<Vec<_>>()).collect();
    let query: Vec<f32> = (0..HQ).flat_map(|j| query_row(j, &mut rng)).collect();

    let context = Context::cpu()?;
    let prefill = Prefill::new(Shape::new(S, H, HQ, D), &keys, &values).queries(&window);
    let cache = context.compress(&prefill, &CompressOptions::new().retain_fraction(0.1))?;
    let out = cache.decode_to_vec(&query)?;

    // Exact attention over the original keys and values.
    let mut expected = vec![0f64; HQ * D];
    for j in 0..HQ {
        let h = j / (HQ / H);
        let q = &query[j * D..(j + 1) * D];
        let logits: Vec<f64> = (0..S)
            .map(|t| rotated[h * S + t].iter().zip(q).map(|(k, q)| k * *q as f64).sum::<f64>() / (D as f64).sqrt())
            .collect();
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let total: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        for (t, l) in logits.iter().enumerate() {
            for d in 0..D {
                expected[j * D + d] += (l - max).exp() / total * values[(h * S + t) * D + d] as f64;
            }
        }
    }
    let dot: f64 = out.iter().zip(&expected).map(|(a, b)| *a as f64 * b).sum();
    let cosine = dot / (out.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt() * expected.iter().map(|b| b * b).sum::<f64>().sqrt());

    let stats = cache.stats()?;
    println!(
        "anchorkv rust: {:.1}x smaller ({} of {} bytes), cosine to exact attention {:.4}",
        stats.ratio, stats.compressed_bytes, stats.full_bytes, cosine
    );
    let restored = context.deserialize(&cache.serialize()?)?;
    assert_eq!(restored.decode_to_vec(&query)?, out, "serialize round trip changed the output");
    if stats.compressed_bytes > stats.budget_bytes || cosine < 0.8 {
        eprintln!("check failed");
        std::process::exit(1);
    }
    Ok(())
}
