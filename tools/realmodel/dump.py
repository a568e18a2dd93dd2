#!/usr/bin/env python3
"""Dump one real prompt's K/V/Q from SmolLM2-135M-Instruct for `anchorkv eval --data`.

The file is the safetensors layout of tools/cli/README-data.md:
  k, v      [L, H, S, D]   the prompt's keys (pre-RoPE) and values
  q_window  [L, Hq, W, D]  post-RoPE queries of the last W prompt positions (W = 64 by
                           default: the eval hands each method the last min(its window, W),
                           and SnapKV/PyramidKV/AdaKV observe 64)
  q_future  [L, Hq, F, D]  post-RoPE queries of the F tokens after the prompt (positions
                           S..S+F-1): the answer prefix "The pass key is" and the greedy
                           answer with the exact numpy cache; never in the window
  metadata  rope_style=gptj, rope_base from the GGUF, plus the prompt's description.

The prompt is the pass-key prompt of passkey.py (--length tokens, needle at --depth), or
--text FILE (its first --length tokens, no chat template). The prefill comes from (and goes
to) passkey.py's prefill cache when the prompt is the same.

    dump.py --length 8192 --out /tmp/realmodel/dump_8k.safetensors
    build/tools/cli/anchorkv eval --data /tmp/realmodel/dump_8k.safetensors
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import passkey  # noqa: E402
import smollm2  # noqa: E402


def _write_safetensors():
    """tools/cli/scripts/make_eval_data.py's writer (the format by hand, numpy only)."""
    path = smollm2.ROOT / "tools" / "cli" / "scripts" / "make_eval_data.py"
    spec = importlib.util.spec_from_file_location("make_eval_data", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.write_safetensors


class RecordingAttention(smollm2.NumpyAttention):
    """The exact numpy cache, keeping every layer's post-RoPE queries."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queries = [[] for _ in range(len(self.lengths))]

    def attend(self, layer, k_pre, v, q_post, positions):
        self.queries[layer].append(np.array(q_post, np.float32))
        return super().attend(layer, k_pre, v, q_post, positions)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens S")
    parser.add_argument("--out", default=None,
                        help="output file (default /tmp/realmodel/dump_<S>.safetensors)")
    parser.add_argument("--window", type=int, default=64, help="q_window positions W")
    parser.add_argument("--future", type=int, default=16, help="held-out queries F")
    parser.add_argument("--dtype", choices=["f32", "f16", "bf16"], default="bf16",
                        help="dtype of k, v and the queries in the file")
    parser.add_argument("--depth", type=float, default=0.15,
                        help="needle depth of the pass-key prompt (default 0.15 with --trial 1: "
                             "trial 1 of passkey.py's 10-trial grid, whose prefill it shares; at "
                             "8K the full cache answers it)")
    parser.add_argument("--trial", type=int, default=1, help="pass-key trial (the key)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefix-in-prompt", action="store_true",
                        help="the answer prefix inside the prompt (as passkey.py)")
    parser.add_argument("--text", default=None,
                        help="use this text file's first --length tokens instead of the pass-key prompt")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    cache_dir = Path(args.cache_dir) if args.cache_dir else smollm2.default_cache_dir()
    if args.out:
        out = Path(args.out)
    else:
        size = f"{args.length // 1024}k" if args.length % 1024 == 0 else str(args.length)
        out = Path(f"/tmp/realmodel/dump_{size}.safetensors")
    started = time.time()
    model, tok = smollm2.load_model(cache_dir), smollm2.load_tokenizer(cache_dir)
    c = model.config
    if args.window > 64 and args.text is None:
        parser.error("--window is at most 64 (the prefill keeps 64 window queries)")
    if args.text is None:
        data = passkey.load_trial(model, tok, cache_dir, args.length, args.trial, args.seed,
                                  args.depth, args.prefix_in_prompt)
        keys, values, q_window, logits = data.keys, data.values, data.q_window, data.logits
        forced = data.prompt.forced
        description = (f"pass-key prompt, key {data.prompt.key}, needle at token "
                       f"{data.prompt.needle_start} (depth {args.depth}); q_future: the answer "
                       f"prefix and greedy answer")
    else:
        tokens = tok.encode(Path(args.text).read_text())
        if len(tokens) < args.length:
            parser.error(f"{args.text} has {len(tokens)} tokens, fewer than --length {args.length}")
        pre = model.prefill(tokens[:args.length], window=max(args.window, 64))
        keys, values, q_window, logits = pre.keys, pre.values, pre.q_window, pre.logits
        forced = []
        description = f"{Path(args.text).name}: first {args.length} tokens; q_future: greedy continuation"
    S = args.length
    W = args.window
    attention = RecordingAttention(model, keys, values, reserve=args.future + 8)
    generated = smollm2.greedy(model, logits, S, attention, max(1, args.future - len(forced) + 1),
                               stop_ids=(), forced=forced)
    q_future = np.stack([np.concatenate(per_layer, axis=1)[:, :args.future]
                         for per_layer in attention.queries])  # [L][Hq][F][D]
    if q_future.shape[2] < args.future:
        raise RuntimeError(f"recorded {q_future.shape[2]} future queries, wanted {args.future}")
    tensors = {"k": np.asarray(keys), "v": np.asarray(values),
               "q_window": np.ascontiguousarray(np.asarray(q_window)[:, :, -W:]),
               "q_future": q_future}
    metadata = {"rope_style": "gptj", "rope_base": repr(float(c.rope_base)), "rotary_dim": "0",
                "keys_post_rope": "0", "position_offset": "0",
                "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, numpy forward in float32)",
                "prompt": description,
                "continuation": tok.decode(forced + generated)}
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_safetensors()(str(out), tensors, metadata, {name: args.dtype for name in tensors})
    shape = {name: list(array.shape) for name, array in tensors.items()}
    print(f"wrote {out} ({out.stat().st_size / 1e6:.0f} MB, {args.dtype}): {shape}; "
          f"continuation {metadata['continuation']!r}; {time.time() - started:.1f} s")


if __name__ == "__main__":
    main()
