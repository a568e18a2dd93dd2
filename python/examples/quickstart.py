"""Compress one layer's KV cache ~10x, decode a new token, compare with exact attention."""
import numpy as np

import anchorkv

H, HQ, S, D, W = 2, 4, 1024, 64, 32  # KV heads, query heads, prompt length, head dim, window
rng = np.random.default_rng(0)


def rope(x, positions):  # NeoX rotate-half, base 10000: what the model applied to its keys
    half = x.shape[-1] // 2
    angles = positions[:, None] * 10000.0 ** (-np.arange(half) / half)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * np.cos(angles) - b * np.sin(angles),
                           b * np.cos(angles) + a * np.sin(angles)], axis=-1)


def exact_attention(q, keys, values):  # q [HQ][D], keys post-RoPE [H][S][D]
    k = np.repeat(keys, HQ // H, axis=0)
    v = np.repeat(values, HQ // H, axis=0)
    logits = np.einsum("hd,htd->ht", q, k) / np.sqrt(D)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return np.einsum("ht,htd->hd", p / p.sum(axis=-1, keepdims=True), v)


# A synthetic layer: keys drift smoothly over a few directions; each query head keeps coming
# back to a few "topic" tokens (what the window queries reveal and later queries reuse).
walk = np.cumsum(rng.standard_normal((H, S, 8)), axis=1) / np.sqrt(S)
keys = (walk @ rng.standard_normal((H, 8, D)) + 0.3 * rng.standard_normal((H, S, D))).astype(np.float32)
values = rng.standard_normal((H, S, D)).astype(np.float32)
rotated = rope(keys, np.arange(S))
topics = rng.choice(S - W, (HQ, 4), replace=False)


def queries(n):
    picks = [rotated[j // (HQ // H), rng.choice(topics[j], n)] for j in range(HQ)]
    q = np.stack([3 * p / np.linalg.norm(p, axis=-1, keepdims=True) * D ** 0.25 for p in picks])
    return (q + 0.5 * rng.standard_normal(q.shape)).astype(np.float32)


window_queries = queries(W)  # [HQ][W][D], post-RoPE, the last W prompt positions
with anchorkv.Context() as context:
    cache = context.compress(keys, values, window_queries, retain_fraction=0.1)
    query = queries(1)[:, 0]  # [HQ][D]
    out = cache.decode(query)
    expected = exact_attention(query, rotated, values)
    cos = float((out * expected).sum() / np.linalg.norm(out) / np.linalg.norm(expected))
    stats = cache.stats
    print(f"anchorkv python: {stats.ratio:.1f}x smaller ({stats.compressed_bytes} of "
          f"{stats.full_bytes} bytes), cosine to exact attention {cos:.4f}")
    assert stats.compressed_bytes <= stats.budget_bytes and cos > 0.8
    restored = anchorkv.Cache.from_bytes(bytes(cache), context)  # serialize round trip
    assert np.array_equal(restored.decode(query), out)
    cache.close()
    restored.close()
