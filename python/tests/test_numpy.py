"""Round trips on the CPU backend against the numpy reference of exact attention."""
import numpy as np
import pytest

import anchorkv
from conftest import make_layer
from reference import attention, bf16_bits, bf16_to_f32, cosine, rope, round_to_bf16

# fp32 accumulation over a few hundred tokens against a float64 reference.
ATOL = 2e-5


def stored(x, storage="bf16"):
    """What a cache of that storage dtype holds of x (float32 data)."""
    x = np.asarray(x, dtype=np.float32)
    return round_to_bf16(x) if storage == "bf16" else x.astype(np.float16).astype(np.float32)


def exact_decode(keys, values, queries, positions=None, storage="bf16", **rope_options):
    """Exact attention over what FullKV stores: keys rotated, then rounded to storage."""
    positions = np.arange(keys.shape[1]) if positions is None else positions
    return attention(queries, stored(rope(keys, positions, **rope_options), storage),
                     stored(values, storage))


def test_fullkv_decode_is_exact_attention(layer, rng):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, method="fullkv")
    query = round_to_bf16(rng.standard_normal((4, 1, 64), dtype=np.float32))
    out = cache.decode(query)
    assert out.dtype == np.float32 and out.shape == query.shape
    np.testing.assert_allclose(out, exact_decode(keys, values, query), atol=ATOL)
    # [Hq][D] queries give [Hq][D] outputs
    np.testing.assert_array_equal(cache.decode(query[:, 0]), out[:, 0])


def test_fullkv_without_window_queries(layer, rng):
    keys, values, _ = layer
    cache = anchorkv.compress(keys, values, method="fullkv", num_q_heads=4)
    query = rng.standard_normal((4, 64), dtype=np.float32)
    np.testing.assert_allclose(cache.decode(query)[:, None],
                               exact_decode(keys, values, query[:, None]), atol=ATOL)


@pytest.mark.parametrize("rope_options", [
    dict(rope_style="none"),
    dict(rope_style="neox", rope_base=500000.0),
    dict(rope_style="gptj"),
    dict(rope_style="neox", rotary_dim=32),
    dict(rope_style="gptj", rotary_dim=16),
])
def test_rope_variants(layer, rng, rope_options):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, method="fullkv", **rope_options)
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    reference_options = {"style": rope_options["rope_style"],
                         "rotary_dim": rope_options.get("rotary_dim", 0),
                         "base": rope_options.get("rope_base", 10000.0)}
    np.testing.assert_allclose(cache.decode(query),
                               exact_decode(keys, values, query, **reference_options), atol=ATOL)


def test_inverse_frequency_table_and_positions(layer, rng):
    keys, values, window = layer
    inv_freq = (0.25 * 10000.0 ** (-2.0 * np.arange(32) / 64)).astype(np.float32)  # linear scaling
    positions = 1000 + 3 * np.arange(keys.shape[1])  # int64: converted to int32 once
    cache = anchorkv.compress(keys, values, window, method="fullkv", inv_freq=inv_freq,
                              positions=positions)
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    expected = attention(query, stored(rope(keys, positions, inv_freq=inv_freq)), values)
    np.testing.assert_allclose(cache.decode(query), expected, atol=ATOL)


def test_keys_post_rope_and_softmax_scale(layer, rng):
    keys, values, window = layer
    positions = np.arange(keys.shape[1])
    post_rope = rope(keys, positions).astype(np.float32)
    cache = anchorkv.compress(post_rope, values, window, method="fullkv", keys_post_rope=True,
                              softmax_scale=0.05, storage_dtype="f16")
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    expected = attention(query, stored(rope(keys, positions), "f16"), values, scale=0.05)
    np.testing.assert_allclose(cache.decode(query), expected, atol=1e-4)


def test_float16_inputs_and_outputs(rng):
    keys, values, window = (a.astype(np.float16) for a in make_layer(rng, bf16_exact=False))
    cache = anchorkv.compress(keys, values, window, method="fullkv")
    assert cache.stats.storage_dtype == anchorkv.DType.F16  # AUTO follows fp16 input
    query = rng.standard_normal((4, 1, 64)).astype(np.float16)
    out = cache.decode(query)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64),
                               exact_decode(keys, values, query, storage="f16"), atol=1e-3)


def test_bfloat16_as_raw_uint16(layer, rng):
    keys, values, window = layer
    with pytest.raises(anchorkv.InvalidArgumentError):
        anchorkv.compress(bf16_bits(keys), bf16_bits(values), bf16_bits(window), method="fullkv")
    cache = anchorkv.compress(bf16_bits(keys), bf16_bits(values), bf16_bits(window),
                              method="fullkv", dtype="bf16")
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    out = cache.decode(bf16_bits(query), dtype="bf16")
    assert out.dtype == np.uint16
    expected = exact_decode(keys, values, round_to_bf16(query))
    np.testing.assert_allclose(bf16_to_f32(out), expected, atol=1e-2)


def test_strided_inputs_are_passed_without_copy(layer, rng):
    keys, values, window = layer
    # Token-major storage [S][H][D] seen as [H][S][D]: strided heads and tokens.
    token_major_keys = np.ascontiguousarray(keys.transpose(1, 0, 2)).transpose(1, 0, 2)
    token_major_values = np.ascontiguousarray(values.transpose(1, 0, 2)).transpose(1, 0, 2)
    assert not token_major_keys.flags.c_contiguous
    strided = anchorkv.compress(token_major_keys, token_major_values, window, method="anchorkv",
                                retain_fraction=0.2)
    dense = anchorkv.compress(keys, values, window, method="anchorkv", retain_fraction=0.2)
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    np.testing.assert_array_equal(strided.decode(query), dense.decode(query))
    assert bytes(strided) == bytes(dense)


def test_anchorkv_decode_equals_attention_over_reconstruction(layer, rng):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, retain_fraction=0.2)
    stats = cache.stats
    assert stats.method == anchorkv.Method.ANCHORKV
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    out = cache.decode(query)
    rotated_keys, reconstructed_values, present = cache.reconstruct(rotated=True)
    assert rotated_keys.shape == keys.shape and present.shape == keys.shape[:2]
    assert present.all()  # AnchorKV drops no token
    penalty = cache.logit_penalty()  # logit_correction: the reconstructed tokens' share
    assert penalty.min() >= 0 and (penalty[:, -32:] == 0).all()  # the window is exact
    np.testing.assert_allclose(out, attention(query, rotated_keys, reconstructed_values, penalty=penalty),
                               atol=ATOL)
    # Pre-RoPE reconstruction rotated by the reference gives the same keys.
    plain_keys, _, _ = cache.reconstruct(rotated=False)
    np.testing.assert_allclose(rope(plain_keys, np.arange(keys.shape[1])), rotated_keys, atol=1e-4)
    # The window is stored exactly, and the compressed prompt adds information: the output is
    # closer to exact attention than attention over the exact window alone. (These i.i.d.
    # Gaussian tokens are the worst case for anchor projection, no token explains another: the
    # cosine is 0.4-0.65 here, against 0.3-0.45 for the window alone.)
    np.testing.assert_array_equal(plain_keys[:, -32:], keys[:, -32:])
    np.testing.assert_array_equal(reconstructed_values[:, -32:], values[:, -32:])
    exact = exact_decode(keys, values, query)
    S = keys.shape[1]
    window_only = exact_decode(keys[:, -32:], values[:, -32:], query, positions=np.arange(S - 32, S))
    assert cosine(out, exact) > cosine(window_only, exact)


def test_stats_budget_and_compressed_size(layer):
    keys, values, window = layer
    theta = 0.2
    cache = anchorkv.compress(keys, values, window, retain_fraction=theta)
    stats = cache.stats
    heads, seq_len, head_dim = keys.shape
    assert stats.shape == anchorkv.Shape(seq_len, heads, 4, head_dim)
    assert stats.full_bytes == 4 * seq_len * heads * head_dim
    assert stats.budget_bytes == int(theta * stats.full_bytes)
    assert stats.base_bytes <= stats.compressed_bytes <= stats.budget_bytes
    assert stats.ratio == pytest.approx(stats.full_bytes / stats.compressed_bytes)
    assert stats.window == 32 and stats.anchors >= 32
    assert stats.allocated_bytes >= stats.compressed_bytes
    assert stats.compressed_bytes == anchorkv.compressed_size(seq_len, heads, head_dim,
                                                              num_q_heads=4, retain_fraction=theta)
    per_head = cache.head_stats()
    assert len(per_head) == heads
    assert sum(h.key_residuals for h in per_head) == stats.key_residuals
    assert sum(h.value_residuals for h in per_head) == stats.value_residuals
    assert all(h.kept_tokens == seq_len and h.anchors == stats.anchors for h in per_head)
    assert stats.key_residuals + stats.value_residuals > 0
    assert stats.storage_format == 3 and stats.segment_tokens >= 256


def test_storage_format_two_is_the_papers_layout(layer):
    keys, values, window = layer
    heads, seq_len, head_dim = keys.shape
    two = anchorkv.compress(keys, values, window, retain_fraction=0.2, storage_format=2)
    three = anchorkv.compress(keys, values, window, retain_fraction=0.2)
    assert (two.stats.storage_format, two.stats.segment_tokens) == (2, 0)
    assert three.stats.base_bytes < two.stats.base_bytes  # one-byte indices and coefficients
    assert two.stats.compressed_bytes == anchorkv.compressed_size(
        seq_len, heads, head_dim, num_q_heads=4, retain_fraction=0.2, storage_format=2)
    with pytest.raises(anchorkv.InvalidArgumentError, match="storage_format"):
        anchorkv.compress(keys, values, window, retain_fraction=0.2, storage_format=5)


def test_append_then_decode_causal(layer, rng):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, retain_fraction=0.2)
    cache.reserve(16)
    assert cache.stats.append_capacity >= 16
    new_keys = round_to_bf16(rng.standard_normal((2, 3, 64), dtype=np.float32))
    new_values = round_to_bf16(rng.standard_normal((2, 3, 64), dtype=np.float32))
    cache.append(new_keys, new_values)
    cache.append(new_keys[:, 0], new_values[:, 0])  # one token as [H][D]
    stats = cache.stats
    assert stats.appended_tokens == 4 and cache.num_tokens == keys.shape[1] + 4
    assert stats.appended_bytes == 4 * 4 * 2 * 64
    rotated_keys, reconstructed_values, _ = cache.reconstruct(rotated=True)
    np.testing.assert_array_equal(reconstructed_values[:, -4:-1], new_values)  # stored exactly
    queries = rng.standard_normal((4, 3, 64), dtype=np.float32)
    out = cache.decode(queries)  # q_len 3: causal among the last tokens
    np.testing.assert_allclose(out, attention(queries, rotated_keys, reconstructed_values,
                                              penalty=cache.logit_penalty()), atol=ATOL)
    # Appended keys are rotated at positions S, S+1, ... (continuing the prompt); the cache
    # may store them rotated, rounded to bf16: one bf16 ulp of slack.
    positions = np.arange(keys.shape[1], keys.shape[1] + 3)
    np.testing.assert_allclose(rotated_keys[:, -4:-1], rope(new_keys, positions), rtol=2**-8, atol=1e-6)


def test_append_with_explicit_positions(layer, rng):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, method="fullkv")
    new_keys = round_to_bf16(rng.standard_normal((2, 2, 64), dtype=np.float32))
    cache.append(new_keys, new_keys, positions=[400, 410])
    rotated_keys, _, _ = cache.reconstruct(rotated=True)
    np.testing.assert_allclose(rotated_keys[:, -2:], rope(new_keys, np.array([400, 410])),
                               rtol=2**-8, atol=1e-6)
    with pytest.raises(anchorkv.InvalidArgumentError):  # not above the stored positions
        cache.append(new_keys[:, :1], new_keys[:, :1], positions=[5])


def test_decode_batch_matches_single_decodes(rng):
    with anchorkv.Context(num_threads=2) as context:
        first = context.compress(*make_layer(rng, seq_len=256), retain_fraction=0.2)
        second = context.compress(*make_layer(rng, seq_len=320), retain_fraction=0.2)
        queries = rng.standard_normal((2, 4, 1, 64), dtype=np.float32)
        out = context.decode_batch([first, second], queries)
        np.testing.assert_allclose(out[0], first.decode(queries[0]), atol=1e-6)
        np.testing.assert_allclose(out[1], second.decode(queries[1]), atol=1e-6)


def test_serialization_round_trip(layer, rng):
    keys, values, window = layer
    cache = anchorkv.compress(keys, values, window, retain_fraction=0.2)
    cache.append(keys[:, :2], values[:, :2])
    data = bytes(cache)
    assert len(data) <= cache.serialized_size()
    restored = anchorkv.Cache.from_bytes(data)
    assert restored.stats == cache.stats or (
        # allocation headroom (append capacity) need not survive the trip
        restored.stats.compressed_bytes == cache.stats.compressed_bytes
        and restored.stats.appended_tokens == cache.stats.appended_tokens)
    queries = rng.standard_normal((4, 2, 64), dtype=np.float32)
    np.testing.assert_array_equal(restored.decode(queries), cache.decode(queries))
    assert bytes(restored) == data
    # Into a caller's buffer, and through a given context, from a memoryview.
    buffer = bytearray(cache.serialized_size())
    written = cache.serialize_into(buffer)
    assert bytes(buffer[:written]) == data
    with anchorkv.Context() as context:
        again = context.deserialize(memoryview(buffer)[:written])
        np.testing.assert_array_equal(again.decode(queries), cache.decode(queries))


def test_cache_outlives_closed_context(layer, rng):
    keys, values, window = layer
    with anchorkv.Context() as context:
        cache = context.compress(keys, values, window, method="fullkv")
    assert context.closed and not cache.closed
    query = rng.standard_normal((4, 64), dtype=np.float32)
    np.testing.assert_allclose(cache.decode(query)[:, None],
                               exact_decode(keys, values, query[:, None]), atol=ATOL)
    with pytest.raises(anchorkv.InvalidArgumentError):
        context.compress(keys, values, window)
    cache.close()
    cache.close()  # idempotent
    with pytest.raises(anchorkv.InvalidArgumentError):
        cache.decode(query)


def test_cache_context_manager_and_repr(layer):
    keys, values, window = layer
    with anchorkv.compress(keys, values, window, method="fullkv") as cache:
        assert "S=256" in repr(cache)
        assert cache.context.backend == anchorkv.Backend.CPU
    assert cache.closed and "closed" in repr(cache)


@pytest.mark.parametrize("method, theta", [
    ("snapkv", 0.3), ("pyramidkv", 0.3), ("adakv", 0.3), ("andpro", 0.3), ("quantized", 1.0),
])
def test_baseline_decode_equals_attention_over_what_it_keeps(rng, method, theta):
    """Every method through the same calls: decode = exact attention over reconstruct()."""
    keys, values, window = make_layer(rng, seq_len=512, window=32)
    cache = anchorkv.compress(keys, values, window, method=method, retain_fraction=theta,
                              window=32)
    stats = cache.stats
    assert stats.method == anchorkv.Method.parse(method)
    assert stats.compressed_bytes <= stats.budget_bytes or method == "pyramidkv"
    query = rng.standard_normal((4, 1, 64), dtype=np.float32)
    rotated_keys, reconstructed_values, present = cache.reconstruct(rotated=True)
    if method == "quantized":
        assert present.all()  # every token kept
    else:
        assert 0 < present.mean() < 1  # evicted some, kept some
        assert present[:, -32:].all()  # the window always stays
    expected = attention(query, rotated_keys, reconstructed_values, present=present)
    np.testing.assert_allclose(cache.decode(query), expected, atol=1e-4)
    restored = anchorkv.Cache.from_bytes(bytes(cache))
    np.testing.assert_array_equal(restored.decode(query), cache.decode(query))


def test_numpy_fast_paths_match_the_general_path(rng):
    """decode/append of contiguous numpy arrays skip the general view code: same results."""
    keys, values, window = make_layer(rng)
    fast = anchorkv.compress(keys, values, window, method="fullkv")
    general = anchorkv.compress(keys, values, window, method="fullkv")
    new_keys, new_values = keys[:, :3].copy(), values[:, :3].copy()
    fast.append(new_keys, new_values)
    general.append(new_keys.tolist(), new_values.tolist())  # lists: the general path
    query = rng.standard_normal((2, 4, 64), dtype=np.float32)[0]
    assert np.array_equal(fast.decode(query), general.decode(query.tolist()))
    query.flags.writeable = False  # read-only input: its address is read another way
    assert np.array_equal(fast.decode(query), general.decode(query.tolist()))
    queries = rng.standard_normal((4, 3, 64), dtype=np.float32)
    out = np.empty_like(queries)
    assert fast.decode(queries, out) is out
    np.testing.assert_array_equal(out, general.decode(np.asfortranarray(queries)))
    with pytest.raises(anchorkv.InvalidArgumentError, match="out must be"):
        fast.decode(queries, np.empty((4, 2, 64), np.float32))


def test_compact_folds_the_suffix_and_the_policy_compacts_in_decode(rng):
    keys = rng.standard_normal((2, 1024, 64), dtype=np.float32)
    values = rng.standard_normal((2, 1024, 64), dtype=np.float32)
    window = rng.standard_normal((4, 32, 64), dtype=np.float32)
    cache = anchorkv.compress(keys[:, :768], values[:, :768], window, retain_fraction=0.25)
    cache.append(keys[:, 768:], values[:, 768:])
    cache.compact(window, headroom_tokens=16)
    stats = cache.stats
    assert (stats.shape.seq_len, stats.appended_tokens, stats.compactions) == (1024, 0, 1)
    assert cache.num_tokens == 1024
    assert stats.compressed_bytes + 16 * 4 * 2 * 64 <= 0.25 * 4 * (1024 + 16) * 2 * 64
    with pytest.raises(anchorkv.InvalidArgumentError):
        cache.compact(window)  # no appended tokens to fold
    # The policy: decode with one query per appended token compacts past compact_after tokens.
    auto = anchorkv.compress(keys[:, :768], values[:, :768], window, retain_fraction=0.25, compact_after=64)
    for t in range(768, 768 + 100):
        auto.append(keys[:, t:t + 1], values[:, t:t + 1])
        auto.decode(rng.standard_normal((4, 1, 64), dtype=np.float32))
    assert auto.stats.compactions == 1 and auto.num_tokens == 868
