//! The safe API end to end on the CPU backend, against a reference computed here.
mod common;

use anchorkv::{Backend, Bf16, CompressOptions, Context, ContextOptions, Element, Method, Prefill, RopeStyle, Shape, Status, F16};
use common::{attention, attention_with_penalty, bf16_round, max_abs_diff, rope, to_f64, Dims, Rng};

const H: usize = 2;
const HQ: usize = 4;
const S: usize = 256;
const D: usize = 64;
const W: usize = 32;
/// fp32 accumulation over a few hundred tokens against float64.
const ATOL: f64 = 2e-5;

struct Layer {
    keys: Vec<f32>,
    values: Vec<f32>,
    window: Vec<f32>,
}

fn layer(seed: u64, seq_len: usize) -> Layer {
    let mut rng = Rng::new(seed);
    Layer { keys: rng.bf16_exact(H * seq_len * D), values: rng.bf16_exact(H * seq_len * D), window: rng.bf16_exact(HQ * W * D) }
}

fn shape() -> Shape {
    Shape::new(S, H, HQ, D)
}

fn positions(from: usize, count: usize) -> Vec<f64> {
    (from..from + count).map(|p| p as f64).collect()
}

#[test]
fn fullkv_decode_is_exact_attention() {
    let data = layer(1, S);
    let context = Context::cpu().unwrap();
    let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
    let cache = context.compress(&prefill, &CompressOptions::new().method(Method::FullKv)).unwrap();
    let query = Rng::new(2).bf16_exact(HQ * D);
    let out = cache.decode_to_vec(&query).unwrap();
    // FullKV stores keys rotated, in bf16: the reference rounds the same way.
    let stored_keys: Vec<f64> = rope(&data.keys, H, S, D, &positions(0, S)).iter().map(|&k| bf16_round(k as f32) as f64).collect();
    let expected = attention(&to_f64(&query), &stored_keys, &to_f64(&data.values), &Dims { kv_heads: H, q_heads: HQ, tokens: S, d: D, q_len: 1 });
    assert!(max_abs_diff(&out, &expected) < ATOL, "max diff {}", max_abs_diff(&out, &expected));
}

#[test]
fn anchorkv_compress_decode_stats() {
    let data = layer(3, S);
    let context = Context::new(&ContextOptions { num_threads: 2, ..Default::default() }).unwrap();
    let options = CompressOptions::new().retain_fraction(0.2);
    let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
    let cache = context.compress(&prefill, &options).unwrap();

    let stats = cache.stats().unwrap();
    assert_eq!(stats.method, Some(Method::AnchorKv));
    assert_eq!(stats.shape, shape());
    assert_eq!(stats.full_bytes, (4 * S * H * D) as u64);
    assert_eq!(stats.budget_bytes, (0.2 * stats.full_bytes as f64) as u64);
    assert!(stats.base_bytes <= stats.compressed_bytes && stats.compressed_bytes <= stats.budget_bytes);
    assert_eq!(stats.compressed_bytes as usize, anchorkv::compressed_size(&options, shape()).unwrap());
    assert!((stats.ratio - stats.full_bytes as f64 / stats.compressed_bytes as f64).abs() < 1e-9);
    let heads = cache.head_stats().unwrap();
    assert_eq!(heads.len(), H);
    assert_eq!(heads.iter().map(|h| h.key_residuals).sum::<i64>(), stats.key_residuals);
    assert_eq!(heads.iter().map(|h| h.value_residuals).sum::<i64>(), stats.value_residuals);
    assert!(heads.iter().all(|h| h.kept_tokens == S as i64));

    // Decode equals exact attention over the cache's own reconstruction.
    let query = Rng::new(4).bf16_exact(HQ * D);
    let out = cache.decode_to_vec(&query).unwrap();
    let dense = cache.reconstruct::<f32>(true).unwrap();
    assert_eq!(dense.tokens, S);
    assert!(dense.present.iter().all(|&p| p == 1));
    let penalty = cache.logit_penalty().unwrap(); // logit_correction: the reconstructed tokens' share
    assert!(penalty.iter().all(|&p| p >= 0.0) && penalty[S - W..S].iter().all(|&p| p == 0.0)); // the window is exact
    let expected = attention_with_penalty(&to_f64(&query), &to_f64(&dense.keys), &to_f64(&dense.values), &Dims { kv_heads: H, q_heads: HQ, tokens: S, d: D, q_len: 1 }, &penalty);
    assert!(max_abs_diff(&out, &expected) < ATOL);

    // The window is stored exactly (pre-RoPE reconstruction of the last W positions).
    let plain = cache.reconstruct::<f32>(false).unwrap();
    for h in 0..H {
        let last = (h * S + S - W) * D..(h * S + S) * D;
        assert_eq!(plain.keys[last.clone()], data.keys[last.clone()]);
        assert_eq!(plain.values[last.clone()], data.values[last]);
    }
}

#[test]
fn append_then_causal_decode() {
    let data = layer(5, S);
    let context = Context::cpu().unwrap();
    let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
    let mut cache = context.compress(&prefill, &CompressOptions::new().retain_fraction(0.2)).unwrap();
    cache.reserve(8).unwrap();
    assert!(cache.stats().unwrap().append_capacity >= 8);
    let mut rng = Rng::new(6);
    let (new_keys, new_values) = (rng.bf16_exact(H * 3 * D), rng.bf16_exact(H * 3 * D));
    cache.append(&new_keys, &new_values, None).unwrap();
    let stats = cache.stats().unwrap();
    assert_eq!(stats.appended_tokens, 3);
    assert_eq!(cache.num_tokens().unwrap(), S + 3);

    let queries = rng.bf16_exact(HQ * 3 * D); // q_len 3, causal among themselves
    let out = cache.decode_to_vec(&queries).unwrap();
    let dense = cache.reconstruct::<f32>(true).unwrap();
    let penalty = cache.logit_penalty().unwrap();
    assert!(penalty[H * (S + 3) - 3..].iter().all(|&p| p == 0.0)); // appended tokens are exact
    let expected = attention_with_penalty(&to_f64(&queries), &to_f64(&dense.keys), &to_f64(&dense.values), &Dims { kv_heads: H, q_heads: HQ, tokens: S + 3, d: D, q_len: 3 }, &penalty);
    assert!(max_abs_diff(&out, &expected) < ATOL);
    // Appended values are stored exactly; keys rotated at positions S.. (one bf16 ulp).
    let rotated_new = rope(&new_keys, H, 3, D, &positions(S, 3));
    for h in 0..H {
        for t in 0..3 {
            for d in 0..D {
                let got = dense.keys[(h * (S + 3) + S + t) * D + d] as f64;
                let want = rotated_new[(h * 3 + t) * D + d];
                assert!((got - want).abs() <= want.abs() / 256.0 + 1e-6, "key {h} {t} {d}: {got} vs {want}");
                assert_eq!(dense.values[(h * (S + 3) + S + t) * D + d], new_values[(h * 3 + t) * D + d]);
            }
        }
    }
}

#[test]
fn f16_and_bf16_slices() {
    let data = layer(7, S);
    let context = Context::cpu().unwrap();
    let options = CompressOptions::new().method(Method::FullKv);
    let query: Vec<f32> = Rng::new(8).bf16_exact(HQ * D);
    let reference = {
        let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
        context.compress(&prefill, &options).unwrap().decode_to_vec(&query).unwrap()
    };

    let half = |x: &[f32]| x.iter().map(|&v| F16::from_f32(v)).collect::<Vec<_>>();
    let (keys, values, window) = (half(&data.keys), half(&data.values), half(&data.window));
    let cache = context.compress(&Prefill::new(shape(), &keys, &values).queries(&window), &options).unwrap();
    assert_eq!(cache.stats().unwrap().storage_dtype, Some(anchorkv::DType::F16));
    let out = cache.decode_to_vec(&half(&query)).unwrap();
    assert!(max_abs_diff(&out.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), &to_f64(&reference)) < 5e-3);

    // bf16 from raw u16 bits, as a model's tensor would come.
    let bits = |x: &[f32]| x.iter().map(|&v| Bf16::from_f32(v).0).collect::<Vec<u16>>();
    let (key_bits, value_bits, window_bits, query_bits) = (bits(&data.keys), bits(&data.values), bits(&data.window), bits(&query));
    let prefill = Prefill::new(shape(), Bf16::from_bits_slice(&key_bits), Bf16::from_bits_slice(&value_bits))
        .queries(Bf16::from_bits_slice(&window_bits));
    let cache = context.compress(&prefill, &options).unwrap();
    let out = cache.decode_to_vec(Bf16::from_bits_slice(&query_bits)).unwrap();
    assert!(max_abs_diff(&out.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), &to_f64(&reference)) < 1e-2);
}

#[test]
fn serialize_round_trip_and_corruption() {
    let data = layer(9, S);
    let context = Context::cpu().unwrap();
    let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
    let mut cache = context.compress(&prefill, &CompressOptions::new().retain_fraction(0.2)).unwrap();
    let one_token: Vec<f32> = (0..H).flat_map(|h| data.keys[h * S * D..h * S * D + D].to_vec()).collect();
    cache.append(&one_token, &one_token, Some(&[S as i32 + 10])).unwrap();

    let bytes = cache.serialize().unwrap();
    assert!(bytes.len() <= cache.serialized_size().unwrap());
    let restored = context.deserialize(&bytes).unwrap();
    assert_eq!(restored.stats().unwrap().compressed_bytes, cache.stats().unwrap().compressed_bytes);
    assert_eq!(restored.stats().unwrap().appended_tokens, 1);
    let queries = Rng::new(10).bf16_exact(HQ * 2 * D);
    assert_eq!(restored.decode_to_vec(&queries).unwrap(), cache.decode_to_vec(&queries).unwrap());
    assert_eq!(restored.serialize().unwrap(), bytes);

    let mut small = vec![0u8; 16];
    assert_eq!(cache.serialize_into(&mut small).unwrap_err().status(), Status::Capacity);
    let mut corrupt = bytes.clone();
    corrupt[bytes.len() / 2] ^= 0x5a;
    let error = context.deserialize(&corrupt).err().expect("corrupt bytes must not load");
    assert_eq!(error.status(), Status::CorruptData);
    assert!(!error.message().is_empty());
    assert_eq!(context.deserialize(&bytes[..bytes.len() / 2]).err().unwrap().status(), Status::CorruptData);
}

#[test]
fn errors_carry_status_and_message() {
    let data = layer(11, S);
    let context = Context::cpu().unwrap();
    let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);

    let budget = context.compress(&prefill, &CompressOptions::new().retain_fraction(0.001)).unwrap_err();
    assert_eq!(budget.status(), Status::Budget);
    assert_eq!(budget.code(), anchorkv::sys::AKV_ERR_BUDGET);
    assert!(budget.message().contains("retain_fraction"), "{budget}");
    assert!(budget.to_string().starts_with("AKV_ERR_BUDGET: "), "{budget}");

    let mut bad = data.keys.clone();
    bad[100] = f32::NAN;
    let prefill_nan = Prefill::new(shape(), &bad, &data.values).queries(&data.window);
    assert_eq!(context.compress(&prefill_nan, &CompressOptions::new().retain_fraction(0.2)).unwrap_err().status(), Status::NonFinite);

    // Lengths are checked before the library sees a pointer.
    let short = Prefill::new(shape(), &data.keys[1..], &data.values).queries(&data.window);
    assert_eq!(context.compress(&short, &CompressOptions::new()).unwrap_err().status(), Status::InvalidArgument);
    let cache = context.compress(&prefill, &CompressOptions::new().method(Method::FullKv)).unwrap();
    let described = format!("{context:?} {cache:?}");
    assert!(described.contains("Context { backend: Cpu") && described.contains("Cache { backend: Cpu, shape: Shape"), "{described}");
    let mut out = vec![0f32; HQ * D];
    assert_eq!(cache.decode(&vec![0f32; HQ * D + 1], &mut out).unwrap_err().status(), Status::InvalidArgument);
    // q_len 2 without an appended token: the library refuses.
    let error = cache.decode_to_vec(&vec![0f32; HQ * 2 * D]).unwrap_err();
    assert_eq!(error.status(), Status::InvalidArgument);
    assert!(error.message().contains("q_len"), "{error}");

    // Caches of two contexts in one batch: the library reports a mismatch.
    let other = Context::cpu().unwrap();
    let foreign = other.compress(&prefill, &CompressOptions::new().method(Method::FullKv)).unwrap();
    let mut batch_out = vec![0f32; 2 * HQ * D];
    let mismatch = context.decode_batch(&[&cache, &foreign], &vec![0f32; 2 * HQ * D], &mut batch_out).unwrap_err();
    assert_eq!(mismatch.status(), Status::Mismatch);
    assert!(!mismatch.message().is_empty());
}

/// The C options carry no length for the inverse-frequency table: the library reads
/// rotary_dim/2 floats from it. A table of another length is refused before the library
/// reads past it (issue 12: `inv_freq(vec![1e-3])` with D = 128 was accepted).
#[test]
fn inv_freq_of_the_wrong_length_is_refused() {
    let data = layer(15, S);
    let context = Context::cpu().unwrap();
    let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
    for table in [vec![1e-3f32], vec![1e-3f32; D / 2 - 1], vec![1e-3f32; D / 2 + 1], vec![1e-3f32; D]] {
        let options = CompressOptions::new().retain_fraction(0.5).inv_freq(table.clone());
        let error = context.compress(&prefill, &options).err().expect("a short or long table was accepted");
        assert_eq!(error.status(), Status::InvalidArgument);
        assert!(error.message().contains("inv_freq"), "{error}");
        assert_eq!(anchorkv::compressed_size(&options, shape()).unwrap_err().status(), Status::InvalidArgument);
    }
    // Partial rotation: rotary_dim/2 entries.
    let partial = CompressOptions::new().method(Method::FullKv).rope(RopeStyle::NeoX, 16, 10000.0);
    assert!(context.compress(&prefill, &partial.clone().inv_freq(vec![1e-3; D / 2])).is_err());
    context.compress(&prefill, &partial.inv_freq(vec![1e-3; 8])).unwrap();
    context.compress(&prefill, &CompressOptions::new().method(Method::FullKv).inv_freq(vec![1e-3; D / 2])).unwrap();
    // Without a rotation the table is not read.
    let none = CompressOptions::new().method(Method::FullKv).rope(RopeStyle::None, 0, 10000.0).inv_freq(vec![1e-3; 3]);
    context.compress(&prefill, &none).unwrap();
}

#[test]
fn cuda_context_is_unavailable_or_refuses_host_slices() {
    match Context::new(&ContextOptions { backend: Backend::Cuda, ..Default::default() }) {
        Err(error) => assert!(matches!(error.status(), Status::BackendUnavailable | Status::Backend), "{error}"),
        Ok(context) => {
            let data = layer(12, S);
            let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
            assert_eq!(context.compress(&prefill, &CompressOptions::new()).err().unwrap().status(), Status::Mismatch);
        }
    }
}

#[test]
fn decode_batch_matches_single_decodes() {
    let context = Context::cpu().unwrap();
    let (first, second) = (layer(13, S), layer(14, 320));
    let options = CompressOptions::new().retain_fraction(0.2);
    let a = context.compress(&Prefill::new(shape(), &first.keys, &first.values).queries(&first.window), &options).unwrap();
    let b = context
        .compress(&Prefill::new(Shape::new(320, H, HQ, D), &second.keys, &second.values).queries(&second.window), &options)
        .unwrap();
    let queries = Rng::new(15).bf16_exact(2 * HQ * D);
    let mut out = vec![0f32; queries.len()];
    context.decode_batch(&[&a, &b], &queries, &mut out).unwrap();
    let single_a = a.decode_to_vec(&queries[..HQ * D]).unwrap();
    let single_b = b.decode_to_vec(&queries[HQ * D..]).unwrap();
    assert!(max_abs_diff(&out[..HQ * D], &to_f64(&single_a)) < 1e-6);
    assert!(max_abs_diff(&out[HQ * D..], &to_f64(&single_b)) < 1e-6);
}

#[test]
fn caches_outlive_their_context_and_move_between_threads() {
    let data = layer(16, S);
    let context = Context::cpu().unwrap();
    let prefill = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
    let options = CompressOptions::new().retain_fraction(0.2);
    let caches = vec![context.compress(&prefill, &options).unwrap(), context.compress(&prefill, &options).unwrap()];
    drop(context); // the caches hold the C context
    let query = Rng::new(17).bf16_exact(HQ * D);
    let outputs: Vec<Vec<f32>> = caches
        .into_iter()
        .map(|cache| {
            let query = query.clone();
            std::thread::spawn(move || cache.decode_to_vec(&query).unwrap()) // Send
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|thread| thread.join().unwrap())
        .collect();
    assert_eq!(outputs[0], outputs[1]); // same input, same seed: same cache
}

#[test]
fn baselines_decode_over_the_tokens_they_keep() {
    let seq_len = 512;
    let data = layer(18, seq_len);
    let shape = Shape::new(seq_len, H, HQ, D);
    let context = Context::cpu().unwrap();
    let prefill = Prefill::new(shape, &data.keys, &data.values).queries(&data.window);
    let snap = CompressOptions::for_method(Method::SnapKv);
    assert_eq!((snap.raw().window, snap.raw().pool_kernel), (64, 5)); // the paper's KVPress setup
    for (method, theta) in [(Method::SnapKv, 0.3), (Method::AdaKv, 0.3), (Method::AnDPro, 0.3), (Method::Quantized, 1.0)] {
        let options = CompressOptions::for_method(method).window(W as i32).retain_fraction(theta);
        let cache = context.compress(&prefill, &options).unwrap();
        assert_eq!(cache.stats().unwrap().method, Some(method));
        let dense = cache.reconstruct::<f32>(true).unwrap();
        let kept = dense.present.iter().filter(|&&p| p == 1).count();
        if method == Method::Quantized {
            assert_eq!(kept, H * seq_len);
        } else {
            assert!(kept < H * seq_len && kept > H * W, "{method:?} kept {kept}");
        }
        // Exact attention over the kept rows only: an evicted row gets no weight.
        let query = Rng::new(19).bf16_exact(HQ * D);
        let out = cache.decode_to_vec(&query).unwrap();
        let mut expected = vec![0f64; HQ * D];
        for j in 0..HQ {
            let h = j / (HQ / H);
            let rows: Vec<usize> = (0..seq_len).filter(|&t| dense.present[h * seq_len + t] == 1).collect();
            let pick = |x: &[f32]| rows.iter().flat_map(|&t| x[(h * seq_len + t) * D..][..D].to_vec()).collect::<Vec<f32>>();
            let one = attention(&to_f64(&query[j * D..(j + 1) * D]), &to_f64(&pick(&dense.keys)), &to_f64(&pick(&dense.values)),
                                &Dims { kv_heads: 1, q_heads: 1, tokens: rows.len(), d: D, q_len: 1 });
            expected[j * D..(j + 1) * D].copy_from_slice(&one);
        }
        assert!(max_abs_diff(&out, &expected) < 1e-4, "{method:?}: {}", max_abs_diff(&out, &expected));
    }
}

/// Token-major `[S][H][D]` keys and values (an engine's layout) and token-major queries go in
/// through strides, without a copy, and compress to the same bytes as the head-major copy.
#[test]
fn strided_prefill_matches_head_major() {
    let data = layer(21, S);
    let token_major = |x: &[f32], heads: usize, tokens: usize| -> Vec<f32> {
        let mut out = vec![0f32; x.len()];
        for h in 0..heads {
            for t in 0..tokens {
                out[(t * heads + h) * D..][..D].copy_from_slice(&x[(h * tokens + t) * D..][..D]);
            }
        }
        out
    };
    let (keys, values, window) = (token_major(&data.keys, H, S), token_major(&data.values, H, S), token_major(&data.window, HQ, W));
    let context = Context::cpu().unwrap();
    let options = CompressOptions::new().retain_fraction(0.2);
    let head_major = Prefill::new(shape(), &data.keys, &data.values).queries(&data.window);
    let strided = Prefill::new(shape(), &keys, &values).queries(&window).kv_strides(D, H * D).query_strides(D, HQ * D);
    let expected = context.compress(&head_major, &options).unwrap().serialize().unwrap();
    assert_eq!(context.compress(&strided, &options).unwrap().serialize().unwrap(), expected);

    // Slices shorter than the strides reach, or a token stride below D, are refused here.
    let short = Prefill::new(shape(), &keys[..keys.len() - 1], &values).kv_strides(D, H * D);
    assert_eq!(context.compress(&short, &options).unwrap_err().status(), Status::InvalidArgument);
    let overlapping = Prefill::new(shape(), &keys, &values).queries(&window).kv_strides(D, D - 1);
    assert!(context.compress(&overlapping, &options).unwrap_err().message().contains("token stride"));
}

#[test]
fn lse_merges_two_halves_into_attention_over_both() {
    // FullKV over the first and the second half of the tokens, merged through their
    // log-sum-exp, is attention over all of them.
    let data = layer(11, S);
    let context = Context::cpu().unwrap();
    let half = S / 2;
    let options = CompressOptions::new().method(Method::FullKv);
    let split = |from: usize| -> (Vec<f32>, Vec<f32>) {
        let mut k = Vec::new();
        let mut v = Vec::new();
        for h in 0..H {
            k.extend_from_slice(&data.keys[(h * S + from) * D..][..half * D]);
            v.extend_from_slice(&data.values[(h * S + from) * D..][..half * D]);
        }
        (k, v)
    };
    let whole = context
        .compress(&Prefill::new(shape(), &data.keys, &data.values).queries(&data.window), &options)
        .unwrap();
    let (k0, v0) = split(0);
    let (k1, v1) = split(half);
    let positions_second: Vec<i32> = (half as i32..S as i32).collect();
    let first = context.compress(&Prefill::new(Shape::new(half, H, HQ, D), &k0, &v0).queries(&data.window), &options).unwrap();
    let second = context
        .compress(&Prefill::new(Shape::new(half, H, HQ, D), &k1, &v1).queries(&data.window).positions(&positions_second), &options)
        .unwrap();
    let query = Rng::new(12).bf16_exact(HQ * D);
    let (mut a, mut b) = (vec![0f32; HQ * D], vec![0f32; HQ * D]);
    let (mut lse_a, mut lse_b) = (vec![0f32; HQ], vec![0f32; HQ]);
    first.decode_with_lse(&query, &mut a, &mut lse_a).unwrap();
    second.decode_with_lse(&query, &mut b, &mut lse_b).unwrap();
    let expected = whole.decode_to_vec(&query).unwrap();
    let mut merged = vec![0f64; HQ * D];
    for r in 0..HQ {
        let m = lse_a[r].max(lse_b[r]) as f64;
        let (wa, wb) = (((lse_a[r] as f64) - m).exp(), ((lse_b[r] as f64) - m).exp());
        for d in 0..D {
            merged[r * D + d] = (wa * a[r * D + d] as f64 + wb * b[r * D + d] as f64) / (wa + wb);
        }
    }
    let expected: Vec<f64> = expected.iter().map(|&x| x as f64).collect();
    let diff = merged.iter().zip(&expected).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    assert!(diff < 1e-5, "merged halves differ from the whole by {diff}");
    assert!(first.decode_with_lse(&query, &mut a, &mut lse_a[..1]).is_err());
}

#[test]
fn compact_folds_the_appended_tokens() {
    let data = layer(13, S + 96);
    let context = Context::cpu().unwrap();
    let (mut k, mut v) = (Vec::new(), Vec::new());
    for h in 0..H {
        k.extend_from_slice(&data.keys[(h * (S + 96)) * D..][..S * D]);
        v.extend_from_slice(&data.values[(h * (S + 96)) * D..][..S * D]);
    }
    let mut cache = context
        .compress(&Prefill::new(shape(), &k, &v).queries(&data.window), &CompressOptions::new().retain_fraction(0.3))
        .unwrap();
    for t in S..S + 96 {
        let (mut kt, mut vt) = (Vec::new(), Vec::new());
        for h in 0..H {
            kt.extend_from_slice(&data.keys[(h * (S + 96) + t) * D..][..D]);
            vt.extend_from_slice(&data.values[(h * (S + 96) + t) * D..][..D]);
        }
        cache.append(&kt, &vt, None).unwrap();
    }
    assert!(cache.compact(&data.window[..D], 0).is_err());
    cache.compact(&data.window, 0).unwrap();
    let stats = cache.stats().unwrap();
    assert_eq!((stats.shape.seq_len, stats.appended_tokens), (S + 96, 0));
    assert!(stats.compressed_bytes as f64 <= 0.3 * stats.full_bytes as f64);
}
