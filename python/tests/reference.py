"""numpy references: bf16 rounding, RoPE and exact attention, in float64."""
from __future__ import annotations

import numpy as np


def round_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to the nearest bfloat16 (ties to even), still float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """The uint16 bit patterns of round_to_bf16(x)."""
    return (round_to_bf16(x).view(np.uint32) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, style: str = "neox", rotary_dim: int = 0,
         base: float = 10000.0, inv_freq: np.ndarray | None = None) -> np.ndarray:
    """Rotate x [heads][tokens][D] at `positions` [tokens]; float64 result."""
    out = np.array(x, dtype=np.float64)
    if style == "none":
        return out
    head_dim = x.shape[-1]
    rotary = rotary_dim or head_dim
    half = rotary // 2
    if inv_freq is None:
        inv_freq = base ** (-2.0 * np.arange(half) / rotary)
    angles = np.asarray(positions, dtype=np.float64)[:, None] * np.asarray(inv_freq, np.float64)[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if style == "neox":
        first, second = np.arange(half), np.arange(half) + half
    elif style == "gptj":
        first, second = 2 * np.arange(half), 2 * np.arange(half) + 1
    else:
        raise ValueError(style)
    a, b = out[..., first].copy(), out[..., second].copy()
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def attention(queries: np.ndarray, keys: np.ndarray, values: np.ndarray,
              scale: float | None = None, present: np.ndarray | None = None,
              penalty: np.ndarray | None = None) -> np.ndarray:
    """Exact attention: queries [Hq][q_len][D], keys (post-RoPE) and values [H][T][D].

    Query head j reads KV head j // (Hq/H); query i sees rows 0..T-q_len+i (causal among
    the new tokens, as akv_decode defines it). present [H][T]: rows an evicting method kept.
    penalty [H][T] (Cache.logit_penalty): each logit lowered by penalty * |scale q|^2.
    """
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    v = np.asarray(values, dtype=np.float64)
    q_heads, q_len, head_dim = q.shape
    heads, tokens, _ = k.shape
    group = q_heads // heads
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale
    k_per_q = np.repeat(k, group, axis=0)
    v_per_q = np.repeat(v, group, axis=0)
    logits = np.einsum("hqd,htd->hqt", q, k_per_q) * scale
    if penalty is not None:
        q2 = (q ** 2).sum(axis=-1) * scale ** 2  # [Hq][q_len]
        logits -= np.repeat(np.asarray(penalty, np.float64), group, axis=0)[:, None, :] * q2[..., None]
    visible = np.arange(tokens)[None, :] <= (tokens - q_len + np.arange(q_len))[:, None]
    logits = np.where(visible[None], logits, -np.inf)
    if present is not None:
        kept = np.repeat(np.asarray(present, bool), group, axis=0)  # [Hq][T]
        logits = np.where(kept[:, None, :], logits, -np.inf)
    logits -= logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits)
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hqt,htd->hqd", weights, v_per_q)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
