#!/usr/bin/env python3
"""How often the split decode kernel rescales what it has accumulated, on a real prompt.

decode_split_kernel (src/cuda/decode_kernels.cuh, softmax_tile) walks a block's tiles of 64
prompt tokens with a running reference max per query row; when a tile's max passes it, the
block rescales its accumulators and every per-anchor weight (k of them per row), which costs
about 27 warp instructions per token and head in that tile (scripts/sass_count.py's RESCALE).
This replays that walk over a dump.py file's exact logits (the first held-out query, post-RoPE
keys, base-2 logits as the kernel has them) and prints the share of tiles that rescale:

  - "every rise": the rule before kRescaleSlack (any row's max rising rescales);
  - "rise > slack": the reference raised only when a tile's max passes it by more than the
    slack (8: a factor of 256), the kernel's rule now.

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
    """Tiles (of the walk) that rescale: tile_max [rows][tiles], blocks of `block` tiles."""
    rows, tiles = tile_max.shape
    events = 0
    for b0 in range(0, tiles, block):
        ref = np.full(rows, -np.inf)
        for t in range(b0, min(b0 + block, tiles)):
            m = tile_max[:, t]
            raise_ = (m > ref + slack) & np.isfinite(ref)
            events += bool(raise_.any())
            ref = np.where(m > ref + slack, m, ref)
    return events


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump", help="a tools/realmodel/dump.py file")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 128], help="tiles a block")
    ap.add_argument("--slack", type=float, default=8.0, help="kRescaleSlack (base-2 logits)")
    args = ap.parse_args(argv)
    t, meta = read_safetensors(args.dump)
    k, q = t["k"], t["q_future"][:, :, 0, :]  # [L, H, S, D], [L, Hq, D] (the first held-out query)
    L, H, S, D = k.shape
    G = q.shape[1] // H
    assert meta.get("rope_style") == "gptj", "dump.py's files (SmolLM2: GPT-J RoPE)"
    rope, positions = smollm2.Rope(D, float(meta["rope_base"])), np.arange(S)
    scale = LOG2E / np.sqrt(D)
    tiles = (S + T - 1) // T
    counts = {(b, rule): 0 for b in args.blocks for rule in ("every rise", "rise > slack")}
    walked = {b: 0 for b in args.blocks}
    for layer in range(L):
        kp = rope.apply(k[layer], positions)
        for h in range(H):
            logits = (q[layer, h * G:(h + 1) * G] @ kp[h].T) * scale  # [G][S]
            pad = np.full((G, tiles * T - S), -np.inf, np.float32)
            tile_max = np.concatenate([logits, pad], axis=1).reshape(G, tiles, T).max(axis=2)
            for b in args.blocks:
                walked[b] += tiles - (tiles + b - 1) // b  # the first tile of a block only sets it
                counts[(b, "every rise")] += rescales(tile_max, b, 0.0)
                counts[(b, "rise > slack")] += rescales(tile_max, b, args.slack)
    print(f"{args.dump}: S {S}, {L} layers x {H} KV heads, {G} rows a head, slack {args.slack:g}")
    print("| tiles a block | rule | tiles that rescale (after a block's first) |")
    print("|---|---|---|")
    for b in args.blocks:
        for rule in ("every rise", "rise > slack"):
            print(f"| {b} | {rule} | {counts[(b, rule)] / max(1, walked[b]):.4f} |")


if __name__ == "__main__":
    main()
