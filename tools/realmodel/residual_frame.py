#!/usr/bin/env python3
"""Would coding key residuals after RoPE cost fidelity? A measurement for a storage format 4.

Format 3 stores a key residual r (pre-RoPE: k - gamma a) as the 2-bit codes of U r (U = H
diag(s) / sqrt(D), docs/design.md), so the decode's logit term q . R_p U^T c needs the
inverse Hadamard and the RoPE rotation per residual token (sass_count.py: "key residuals",
7.7 warp instructions per token and head). Coding R_p r instead (the rotated residual, which
the utilities already compute) makes the term (U q) . c: U q once per query, then a 2-bit dot
product per residual token, as the value residuals already are.

This takes a dump.py file's pre-RoPE keys, makes residual-like vectors (each key minus the
key 64 positions before it, scaled by a random gamma), codes each in both frames with the same
codec (the paper's 4-level Lloyd-Max quantizer of N(0, 1) after U, least-squares scale) and
prints, per frame, the relative reconstruction error and the logit error |q . (R r - rec)|
against the held-out queries' logits, over every layer and head.

    tools/realmodel/residual_frame.py /tmp/realmodel/text_8k.safetensors
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2  # noqa: E402
from rescale_rate import read_safetensors  # noqa: E402

LEVELS = np.array([-1.5104, -0.4528, 0.4528, 1.5104], np.float32)  # Lloyd-Max, N(0, 1), 4 levels
EDGES = np.array([-0.9816, 0.0, 0.9816], np.float32)


def hadamard(n):
    h = np.array([[1.0]], np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def code(x, U):
    """Rows of x coded and decoded by the residual codec (least-squares scale)."""
    y = x @ U.T
    sigma = np.linalg.norm(y, axis=1, keepdims=True) / np.sqrt(y.shape[1]) + 1e-30
    lv = LEVELS[np.searchsorted(EDGES, y / sigma)]
    scale = (y * lv).sum(1, keepdims=True) / ((lv * lv).sum(1, keepdims=True) + 1e-30)
    return (scale * lv) @ U  # U^T (scale * levels)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t, meta = read_safetensors(args.dump)
    k, qf = t["k"], t["q_future"]  # [L, H, S, D], [L, Hq, F, D]
    L, H, S, D = k.shape
    G = qf.shape[1] // H
    assert meta.get("rope_style") == "gptj", "dump.py's files (SmolLM2: GPT-J RoPE)"
    rope, positions = smollm2.Rope(D, float(meta["rope_base"])), np.arange(64, S)
    rng = np.random.default_rng(args.seed)
    U = hadamard(D) * rng.choice([-1.0, 1.0], D).astype(np.float32)[None, :] / np.sqrt(D)
    rec_err = {"pre-RoPE (format 3)": [], "post-RoPE": []}
    logit_err = {name: [] for name in rec_err}
    for layer in range(L):
        for h in range(H):
            gamma = rng.uniform(0.5, 1.5, (S - 64, 1)).astype(np.float32)
            r = k[layer, h, 64:] - gamma * k[layer, h, :-64]          # pre-RoPE residual-like rows
            pos_r = rope.apply(r, positions)  # R_p r
            recs = {"pre-RoPE (format 3)": rope.apply(code(r, U), positions), "post-RoPE": code(pos_r, U)}
            q = qf[layer, h * G:(h + 1) * G, 0, :] / np.sqrt(D)        # [G][D]
            exact = pos_r @ q.T
            for name, rec in recs.items():
                rec_err[name].append(np.linalg.norm(pos_r - rec, axis=1) / (np.linalg.norm(pos_r, axis=1) + 1e-30))
                logit_err[name].append(np.abs(exact - rec @ q.T).ravel() / (np.abs(exact).mean() + 1e-30))
    print(f"{args.dump}: {L} layers x {H} heads x {S - 64} residual-like rows, D {D}")
    print("| frame coded | relative reconstruction error (mean) | logit error / mean |logit| (mean, p99) |")
    print("|---|---|---|")
    for name in rec_err:
        re, le = np.concatenate(rec_err[name]), np.concatenate(logit_err[name])
        print(f"| {name} | {re.mean():.4f} | {le.mean():.4f}, {np.quantile(le, 0.99):.4f} |")


if __name__ == "__main__":
    main()
