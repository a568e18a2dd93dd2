"""Cache.decode(lse=...) and Context.decode_batch(lse=...): the log-sum-exp of each row, and
merging the cache's attention with attention over other tokens (cascade attention)."""
import numpy as np
import pytest

import anchorkv
from conftest import make_layer


def _fresh_rng():
    seed = int(np.random.SeedSequence().entropy % (1 << 63))
    return np.random.default_rng(seed), f"seed {seed}"


def _exact(keys, values, queries, scale, penalty=None):
    """keys/values [H][T][D] (post-RoPE), queries [Hq][D] -> out [Hq][D], lse [Hq] (float64).
    penalty [H][T] (Cache.logit_penalty): each logit lowered by penalty * |scale q|^2."""
    group = queries.shape[0] // keys.shape[0]
    k = np.repeat(keys.astype(np.float64), group, axis=0)
    v = np.repeat(values.astype(np.float64), group, axis=0)
    logits = np.einsum("hd,htd->ht", queries.astype(np.float64), k) * scale
    if penalty is not None:
        q2 = (queries.astype(np.float64) ** 2).sum(axis=1, keepdims=True) * scale ** 2
        logits -= np.repeat(penalty.astype(np.float64), group, axis=0) * q2
    mx = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - mx)
    total = p.sum(axis=1, keepdims=True)
    return np.einsum("ht,htd->hd", p / total, v), (mx + np.log(total))[:, 0]


@pytest.mark.parametrize("method", ["anchorkv", "fullkv"])
def test_lse_merges_with_other_tokens_into_attention_over_the_union(method):
    rng, seed = _fresh_rng()
    keys, values, window_queries = make_layer(rng, seq_len=320)
    options = {"retain_fraction": 0.3} if method == "anchorkv" else {}
    cache = anchorkv.compress(keys, values, window_queries, method=method, **options)
    head_dim = keys.shape[2]
    scale = 1.0 / np.sqrt(head_dim)
    query = rng.standard_normal((4, head_dim), dtype=np.float32)
    out, lse = cache.decode(query, lse=True)
    assert lse.shape == (4,) and lse.dtype == np.float32
    np.testing.assert_array_equal(out, cache.decode(query), err_msg=seed)

    cached_keys, cached_values, _ = cache.reconstruct(rotated=True)
    penalty = cache.logit_penalty()  # AnchorKV's logit_correction (zero for FullKV)
    assert penalty.min() >= 0 and (method == "anchorkv" or penalty.max() == 0)
    _, expected_lse = _exact(cached_keys, cached_values, query, scale, penalty)
    np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-4, err_msg=seed)

    # Other tokens (e.g. an engine's own cache of a suffix): merge by the two log-sum-exps.
    other_keys = rng.standard_normal((2, 40, head_dim), dtype=np.float32)
    other_values = rng.standard_normal((2, 40, head_dim), dtype=np.float32)
    other_out, other_lse = _exact(other_keys, other_values, query, scale)
    m = np.maximum(lse, other_lse)
    wa, wb = np.exp(lse - m)[:, None], np.exp(other_lse - m)[:, None]
    merged = (wa * out + wb * other_out) / (wa + wb)
    union, union_lse = _exact(np.concatenate([cached_keys, other_keys], axis=1),
                              np.concatenate([cached_values, other_values], axis=1), query, scale,
                              np.concatenate([penalty, np.zeros((2, 40), np.float32)], axis=1))
    np.testing.assert_allclose(merged, union, atol=1e-4, err_msg=seed)
    np.testing.assert_allclose(m + np.log(wa + wb)[:, 0], union_lse, atol=1e-4, err_msg=seed)
    assert np.abs(out - union).max() > 1e-2, "the other tokens must matter for the test to mean anything"


def test_decode_batch_lse_equals_per_cache_lse_and_checks_its_output():
    rng, seed = _fresh_rng()
    context = anchorkv.Context()
    caches = [context.compress(*make_layer(rng, seq_len=s), retain_fraction=0.3) for s in (256, 300)]
    queries = rng.standard_normal((2, 4, 1, 64), dtype=np.float32)
    lse = np.full((2, 4, 1), np.nan, dtype=np.float32)
    out = context.decode_batch(caches, queries, lse=lse)
    for b, cache in enumerate(caches):
        one_out, one_lse = cache.decode(queries[b], lse=True)
        np.testing.assert_array_equal(out[b], one_out, err_msg=seed)
        np.testing.assert_array_equal(lse[b], one_lse, err_msg=seed)
    with pytest.raises(anchorkv.InvalidArgumentError, match="lse"):
        context.decode_batch(caches, queries, lse=np.empty((2, 4), dtype=np.float32))
    with pytest.raises(anchorkv.InvalidArgumentError, match="lse"):
        caches[0].decode(queries[0], lse=np.empty((4, 1), dtype=np.float64))
