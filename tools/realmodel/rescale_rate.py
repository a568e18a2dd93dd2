#!/usr/bin/env python3
"""How often the split decode kernel rescales what it has accumulated, on a real prompt.

decode_split_kernel (src/cuda/decode_kernels.cuh, softmax_tile) walks a block's tiles of 64
prompt tokens with a running reference max per query row; when a tile's max passes it, the
block rescales its accumulators and every per-anchor weight (k of them per row), which costs
about 48 warp instructions per token and head in that tile at k 815 (scripts/sass_count.py).
This replays that walk over a dump.py file's exact logits (its held-out queries, post-RoPE
keys, base-2 logits as the kernel has them) and prints the share of tiles that rescale:

  - "every rise": the rule before kRescaleSlack (any row's max rising rescales);
  - "rise > slack": the reference raised only when a tile's max passes it by more than the
    slack (kRescaleSlack, 32: the kernel's rule now; it was 8).

and the largest rise of a tile's max over its block's running max, which a slack above it
never rescales.

A block's first tile only sets the reference. Blocks of 16 and 128 tiles are the kernel's at
32K x 1 and 128K x 1 (predict_decode.py's plans); at 8K a 128-tile block is the whole prompt.

    tools/realmodel/dump.py --length 8192 --text FILE --out /tmp/realmodel/text_8k.safetensors
    tools/realmodel/rescale_rate.py /tmp/realmodel/text_8k.safetensors
"""
import argparse
import json
import struct
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2  # noqa: E402

T = 64  # tokens a tile
LOG2E = 1.4426950408889634


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    kinds = {"F32": np.float32, "F16": np.float16}
    out = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        if h["dtype"] == "BF16":
            raw = np.frombuffer(data[lo:hi], np.uint16).astype(np.uint32) << 16
            arr = raw.view(np.float32)
        else:
            arr = np.frombuffer(data[lo:hi], kinds[h["dtype"]]).astype(np.float32)
        out[name] = arr.reshape(h["shape"])
    return out, meta


def rescales(tile_max, block, slack):
    """Tiles (of the walk) that rescale, and the largest rise of a tile's max over the reference:
    tile_max [rows][tiles], blocks of `block` tiles."""
    rows, tiles = tile_max.shape
    events, jump = 0, 0.0
    for b0 in range(0, tiles, block):
        ref = np.full(rows, -np.inf)
        for t in range(b0, min(b0 + block, tiles)):
            m = tile_max[:, t]
            finite = np.isfinite(ref)
            if finite.any():
                jump = max(jump, float((m - ref)[finite].max()))
            events += bool(((m > ref + slack) & finite).any())
            ref = np.where(m > ref + slack, m, ref)
    return events, jump


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="a tools/realmodel/dump.py file")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 128], help="tiles a block")
    ap.add_argument("--slack", type=float, default=32.0, help="kRescaleSlack (base-2 logits)")
    args = ap.parse_args(argv)
    t, meta = read_safetensors(args.dump)
    k, qs = t["k"], t["q_future"]  # [L, H, S, D], [L, Hq, future, D] (the held-out queries)
    L, H, S, D = k.shape
    G = qs.shape[1] // H
    assert meta.get("rope_style") == "gptj", "dump.py's files (SmolLM2: GPT-J RoPE)"
    rope, positions = smollm2.Rope(D, float(meta["rope_base"])), np.arange(S)
    scale = LOG2E / np.sqrt(D)
    tiles = (S + T - 1) // T
    counts = {(b, rule): 0 for b in args.blocks for rule in ("every rise", "rise > slack")}
    walked, jumps = {b: 0 for b in args.blocks}, {b: 0.0 for b in args.blocks}
    for layer in range(L):
        kp = rope.apply(k[layer], positions)
        for h in range(H):
            for j in range(qs.shape[2]):
                logits = (qs[layer, h * G:(h + 1) * G, j] @ kp[h].T) * scale  # [G][S]
                pad = np.full((G, tiles * T - S), -np.inf, np.float32)
                tile_max = np.concatenate([logits, pad], axis=1).reshape(G, tiles, T).max(axis=2)
                for b in args.blocks:
                    walked[b] += tiles - (tiles + b - 1) // b  # the first tile of a block only sets it
                    events, jump = rescales(tile_max, b, 0.0)
                    counts[(b, "every rise")] += events
                    jumps[b] = max(jumps[b], jump)
                    counts[(b, "rise > slack")] += rescales(tile_max, b, args.slack)[0]
    print(f"{args.dump}: S {S}, {L} layers x {H} KV heads, {G} rows a head, {qs.shape[2]} queries,"
          f" slack {args.slack:g}")
    print("| tiles a block | rule | tiles that rescale (after a block's first) | of tiles walked |")
    print("|---|---|---|---|")
    for b in args.blocks:
        for rule in ("every rise", "rise > slack"):
            n = counts[(b, rule)]
            print(f"| {b} | {rule} | {n / max(1, walked[b]):.4f} | {n} of {walked[b]} |")
    print("largest rise of a tile's max over its block's running max (base-2 logits): "
          + ", ".join(f"{jumps[b]:.2f} ({b} tiles a block)" for b in args.blocks))


if __name__ == "__main__":
    main()
