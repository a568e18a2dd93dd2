#!/usr/bin/env python3
"""Write K/V/Q files for `anchorkv eval --data FILE.safetensors` using numpy only.

The safetensors format is written by hand (no `safetensors` package): an 8-byte
little-endian header length, a JSON header, then the raw little-endian tensor bytes.
`write_safetensors()` is reusable for dumps from a real model: collect per layer the
keys/values [H,S,D], the post-RoPE queries of the last W prompt positions [Hq,W,D] and of
some later positions [Hq,F,D], stack over layers and call it with the RoPE metadata.

Examples:
  make_eval_data.py --out small.safetensors                       # one file
  make_eval_data.py --out-dir DIR                                 # the ctest set, incl. broken files
  anchorkv eval --data small.safetensors

The demo data are only loosely LLM-like (a shared key mean, a low-rank part, noise, a sink
at token 0); use `anchorkv eval` without --data for the documented synthetic generator.
"""
import argparse
import json
import os
import struct

import numpy as np

DTYPE_NAMES = {"f32": "F32", "f16": "F16", "bf16": "BF16"}


def to_bf16_bits(x):
    """float32 array -> uint16 bf16 bit patterns, round to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype(np.uint16)


def encode(array, dtype):
    """Returns (safetensors dtype name, little-endian bytes)."""
    if dtype == "f32":
        return "F32", np.ascontiguousarray(array, dtype="<f4").tobytes()
    if dtype == "f16":
        return "F16", np.ascontiguousarray(array, dtype="<f2").tobytes()
    if dtype == "bf16":
        return "BF16", to_bf16_bits(array).astype("<u2").tobytes()
    raise ValueError(f"unknown dtype {dtype}")


def write_safetensors(path, tensors, metadata, dtypes=None):
    """tensors: name -> numpy array; metadata: str -> str; dtypes: name -> f32|f16|bf16."""
    dtypes = dtypes or {}
    header, blobs, offset = {}, [], 0
    for name, array in tensors.items():
        dtype_name, blob = encode(array, dtypes.get(name, "f32"))
        header[name] = {"dtype": dtype_name, "shape": list(array.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header["__metadata__"] = {key: str(value) for key, value in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the format allows trailing spaces; keeps data aligned
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(text)))
        out.write(text)
        for blob in blobs:
            out.write(blob)


def inverse_frequencies(rotary_dim, base, scale=1.0):
    """fp32 table as models store it (and as anchorkv computes it from a base)."""
    i = np.arange(rotary_dim // 2, dtype=np.float64)
    return (base ** (-2.0 * i / rotary_dim)).astype(np.float32) / np.float32(scale)


def rotate(x, positions, style, rotary_dim, inv_freq):
    """RoPE of x [..., T, D] at positions [T]: neox pairs (i, i+rot/2), gptj pairs (2i, 2i+1)."""
    if style == "none":
        return x.copy()
    angle = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.astype(np.float64).copy()
    half = rotary_dim // 2
    if style == "neox":
        a, b = x[..., :half].astype(np.float64), x[..., half:rotary_dim].astype(np.float64)
        out[..., :half] = a * cos - b * sin
        out[..., half:rotary_dim] = a * sin + b * cos
    else:
        a, b = x[..., 0:rotary_dim:2].astype(np.float64), x[..., 1:rotary_dim:2].astype(np.float64)
        out[..., 0:rotary_dim:2] = a * cos - b * sin
        out[..., 1:rotary_dim:2] = a * sin + b * cos
    return out


def make_tensors(args):
    rng = np.random.default_rng(args.seed)
    L, H, Hq, S, D, W, F = (args.layers, args.heads, args.q_heads, args.seq_len, args.head_dim,
                            args.window, args.future)
    rotary_dim = args.rotary_dim or D
    inv_freq = inverse_frequencies(rotary_dim, args.rope_base, args.inv_freq_scale)
    positions = args.position_offset + np.arange(S)
    k = np.empty((L, H, S, D), np.float32)
    v = np.empty((L, H, S, D), np.float32)
    q_window = np.empty((L, Hq, W, D), np.float32)
    q_future = np.empty((L, Hq, F, D), np.float32)
    for layer in range(L):
        for h in range(H):
            mean = rng.normal(0, 1.0, D)
            basis = rng.normal(0, 1.0, (8, D))
            coeff = rng.normal(0, 1.0, (S, 8))
            keys = mean + coeff @ basis * 0.5 + rng.normal(0, 0.5, (S, D))
            keys[0] += 4.0 * mean  # a sink-like first token
            k_post = rotate(keys, positions, args.rope_style, rotary_dim, inv_freq)
            k[layer, h] = k_post if args.keys_post_rope else keys
            v[layer, h] = rng.normal(0, 1.0, D) * 0.3 + rng.normal(0, 1.0, (S, D))
        group = Hq // H
        for qh in range(Hq):
            mean = k[layer, qh // group].mean(axis=0)
            direction = mean / (np.linalg.norm(mean) + 1e-9)
            for target, count, first in ((q_window, W, S - W), (q_future, F, S)):
                q_pre = rng.normal(0, 1.0, (count, D)) + 2.0 * direction
                pos = args.position_offset + first + np.arange(count)
                target[layer, qh] = rotate(q_pre, pos, args.rope_style, rotary_dim, inv_freq)
    tensors = {"k": k, "v": v, "q_window": q_window, "q_future": q_future}
    if args.inv_freq_scale != 1.0:
        tensors["inv_freq"] = inv_freq
    metadata = {"rope_style": args.rope_style, "rope_base": repr(float(args.rope_base)),
                "rotary_dim": str(rotary_dim), "keys_post_rope": "1" if args.keys_post_rope else "0",
                "position_offset": str(args.position_offset)}
    if args.softmax_scale:
        metadata["softmax_scale"] = repr(float(args.softmax_scale))
    dtypes = {name: args.dtype for name in ("k", "v", "q_window", "q_future")}
    return tensors, metadata, dtypes


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="file to write")
    p.add_argument("--out-dir", help="write the ctest set (valid variants and malformed files) here")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--q-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--future", type=int, default=8)
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="f16")
    p.add_argument("--rope-style", choices=["neox", "gptj", "none"], default="neox")
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--rotary-dim", type=int, default=0, help="0 = head_dim")
    p.add_argument("--keys-post-rope", action="store_true")
    p.add_argument("--position-offset", type=int, default=0)
    p.add_argument("--inv-freq-scale", type=float, default=1.0,
                   help="!= 1 writes an explicit inv_freq table (linear scaling)")
    p.add_argument("--softmax-scale", type=float, default=0.0, help="0 = 1/sqrt(D)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.out and not args.out_dir:
        p.error("give --out FILE or --out-dir DIR")
    return args


def write_test_set(directory, base_args):
    os.makedirs(directory, exist_ok=True)
    variants = {
        "neox_f16": [],
        "gptj_bf16_post": ["--rope-style", "gptj", "--dtype", "bf16", "--keys-post-rope",
                           "--rotary-dim", "64", "--rope-base", "500000"],
        "offset_f32_invfreq": ["--dtype", "f32", "--position-offset", "100", "--inv-freq-scale", "4",
                               "--softmax-scale", "0.1"],
    }
    for name, extra in variants.items():
        args = parse_args(["--out", "unused"] + extra)
        write_safetensors(os.path.join(directory, name + ".safetensors"), *make_tensors(args))
    good = os.path.join(directory, "neox_f16.safetensors")
    with open(good, "rb") as f:
        data = f.read()
    with open(os.path.join(directory, "truncated.safetensors"), "wb") as f:
        f.write(data[:-100])
    broken_json = b'{"k": {"dtype": "F32", '  # cut short: not valid JSON
    with open(os.path.join(directory, "bad_header.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(broken_json)) + broken_json)
    args = parse_args(["--out", "unused"])
    tensors, metadata, dtypes = make_tensors(args)
    del tensors["q_future"]
    write_safetensors(os.path.join(directory, "missing_tensor.safetensors"), tensors, metadata, dtypes)


def main(argv=None):
    args = parse_args(argv)
    if args.out_dir:
        write_test_set(args.out_dir, args)
    if args.out:
        write_safetensors(args.out, *make_tensors(args))


if __name__ == "__main__":
    main()
