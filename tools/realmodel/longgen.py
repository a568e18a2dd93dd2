#!/usr/bin/env python3
"""A long generation on SmolLM2-135M-Instruct with compaction (akv_cache_compact).

A prompt of --prompt tokens (chat template, an instruction, filler text) is prefilled in
numpy and compressed per layer; then --generate tokens of "generated" text are fed through the
library with teacher forcing (model.step with q_len = --chunk: append, then decode). The
generated text gives a pass key early ("IMPORTANT: The pass key is NNNNN. Remember it." after
--key-offset tokens), continues with filler, and ends with a new user turn asking "What is the
pass key?" and the answer prefix "The pass key is "; 8 greedy tokens follow. A trial is
correct when the first 5-digit number of the answer is the key.

Methods, each at every --ratios value (retain_fraction = 1/ratio):
  dense     AnchorKV, the generated tokens stay dense (the paper);
  compact   AnchorKV with compact_after = --compact-after (the policy folds the suffix back
            into the compressed form during decode, with that headroom);
  snapkv    SnapKV, dense suffix (eviction at prefill only);
  snapkv-decode  SnapKV's decode-time variant (the same policy re-evicts at the budget of the
            current length);
plus fullkv (the library's exact cache) and numpy (exact float32 reference).
Per row: correct, the answer, the bytes at the end and their ratio to M_full, the largest
footprint / (theta M_full) after the first compaction, the number of compactions and their
mean time (the decode calls that compacted, all layers).

    longgen.py --prompt 4096 --generate 2048 --ratios 5 10 --trials 2 --csv longgen.csv
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2  # noqa: E402
from passkey import FILLER, first_number, log  # noqa: E402

INSTRUCTION = "Read the following notes, then keep writing in the same style."
QUESTION = "What is the pass key?"
PREFIX = "The pass key is "
MAX_NEW = 8
WINDOW = 32


def build_text(tok, prompt_len: int, gen_len: int, key: int, key_offset: int):
    """(prompt tokens, generated tokens): exactly prompt_len and gen_len tokens."""
    head = tok.encode(f"<|im_start|>system\n{smollm2.DEFAULT_SYSTEM}<|im_end|>\n"
                      f"<|im_start|>user\n{INSTRUCTION}")
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    sentences = [tok.encode(" " + s) for s in FILLER]

    def filler(n, start=0):
        out, i = [], start
        while len(out) < n:
            out += sentences[i % len(sentences)]
            i += 1
        return out[:n]

    prompt = head + filler(prompt_len - len(head) - len(tail)) + tail
    needle = tok.encode(f" IMPORTANT: The pass key is {key}. Remember it.")
    question = tok.encode(f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n"
                          f"<|im_start|>assistant\n{PREFIX}")
    body = gen_len - key_offset - len(needle) - len(question)
    if body < 0:
        raise ValueError("--generate is too short for the needle and the question")
    generated = filler(key_offset, 3) + needle + filler(body, 1) + question
    assert len(prompt) == prompt_len and len(generated) == gen_len
    return prompt, generated


def prefill(model, tokens, cache_dir: Path):
    """Numpy prefill of the prompt (K/V/Qwin/logits), cached under cache_dir."""
    digest = hashlib.sha1(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:12]
    directory = cache_dir / "longgen-v1" / f"L{len(tokens)}-{digest}"
    names = ("keys", "values", "q_window", "logits")
    if not (directory / "logits.npy").is_file():
        pre = model.prefill(tokens)
        directory.mkdir(parents=True, exist_ok=True)
        for name in names:
            np.save(directory / f"{name}.npy", getattr(pre, name))
        log(f"prefill of {len(tokens)} tokens: {pre.seconds:.1f} s")
    return [np.load(directory / f"{name}.npy", mmap_mode="r") for name in names]


class MeteredAttention(smollm2.LibraryAttention):
    """LibraryAttention that times the decode calls in which the policy compacted."""

    def __init__(self, caches):
        super().__init__(caches)
        self.compact_seconds = 0.0
        self.compactions = 0

    def attend(self, layer, k_pre, v, q_post, positions):
        cache = self.caches[layer]
        before = cache.stats.compactions
        started = time.perf_counter()
        out = super().attend(layer, k_pre, v, q_post, positions)
        if cache.stats.compactions > before:
            self.compact_seconds += time.perf_counter() - started
            self.compactions += 1
        return out


def run(model, tok, anchorkv, context, data, prompt, generated, key, method, ratio, args):
    keys, values, q_window, logits = data
    config = model.config
    S = len(prompt)
    started = time.time()
    if method == "numpy":
        attention = smollm2.NumpyAttention(model, keys, values, reserve=len(generated) + MAX_NEW + 8)
    else:
        caches = []
        for layer in range(config.layers):
            options = dict(num_q_heads=config.q_heads, rope_style="gptj", rope_base=config.rope_base,
                           layer_index=layer, layer_count=config.layers)
            if method == "fullkv":
                caches.append(context.compress(keys[layer], values[layer], None, method="fullkv", **options))
                continue
            queries = q_window[layer][:, q_window.shape[2] - WINDOW:]
            options.update(retain_fraction=1.0 / ratio, window=WINDOW)
            if method in ("snapkv", "snapkv-decode"):
                options["method"] = "snapkv"
            if method in ("compact", "snapkv-decode"):
                options["compact_after"] = args.compact_after
            caches.append(context.compress(keys[layer], values[layer], queries, **options))
        for cache in caches:
            cache.reserve(len(generated) + MAX_NEW + 8)
        attention = MeteredAttention(caches)
    H, D, L = config.kv_heads, config.head_dim, config.layers
    worst, first_compaction = 0.0, None
    position = S
    for a in range(0, len(generated), args.chunk):
        piece = generated[a:a + args.chunk]
        out = model.step(piece, np.arange(position, position + len(piece)), attention)
        position += len(piece)
        if method != "numpy" and method != "fullkv":
            stats = [c.stats for c in attention.caches]
            used = sum(s.compressed_bytes + s.appended_bytes for s in stats)
            if first_compaction is None and any(s.compactions for s in stats):
                first_compaction = position
            if first_compaction is not None:
                worst = max(worst, used / ((1.0 / ratio) * 4 * position * H * D * L))
    answer_tokens = smollm2.greedy(model, out[-1], position, attention, MAX_NEW, tok.stop_ids)
    text = tok.decode(answer_tokens)
    row = dict(method=method, ratio=ratio or "", correct=int(first_number(text) == key), answer=text.strip(),
               seconds=round(time.time() - started, 1))
    if method != "numpy":
        stats = [c.stats for c in attention.caches]
        used = sum(s.compressed_bytes + s.appended_bytes for s in stats)
        full = 4 * position * H * D * L
        row.update(bytes_end=used, x_full=round(used / full, 4),
                   worst_after_first_compaction=round(worst, 4) if first_compaction else "",
                   first_compaction_at=first_compaction or "",
                   compactions=attention.compactions,
                   compaction_ms=round(1e3 * attention.compact_seconds / attention.compactions, 1)
                   if attention.compactions else "")
        attention.close()
    return row, answer_tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--generate", type=int, default=2048)
    parser.add_argument("--key-offset", type=int, default=64, help="generated tokens before the needle")
    parser.add_argument("--chunk", type=int, default=64, help="teacher-forcing step (q_len)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[5, 10])
    parser.add_argument("--methods", nargs="+",
                        default=["numpy", "fullkv", "dense", "compact", "snapkv", "snapkv-decode"])
    parser.add_argument("--compact-after", type=int, default=128)
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--first-trial", type=int, default=0, help="index of the first trial (its key)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args(argv)
    if args.chunk < WINDOW:
        parser.error(f"--chunk must be at least the window ({WINDOW}) so that the policy sees its queries")
    anchorkv = smollm2.import_anchorkv()
    cache_dir = Path(args.cache_dir) if args.cache_dir else smollm2.default_cache_dir()
    model, tok = smollm2.load_model(args.cache_dir), smollm2.load_tokenizer(args.cache_dir)
    context = anchorkv.Context(num_threads=args.threads)
    rows = []
    for trial in range(args.first_trial, args.first_trial + args.trials):
        key = int(np.random.default_rng([args.seed, args.prompt, args.generate, trial]).integers(10000, 100000))
        prompt, generated = build_text(tok, args.prompt, args.generate, key, args.key_offset)
        data = prefill(model, prompt, cache_dir)
        for method in args.methods:
            for ratio in ([None] if method in ("numpy", "fullkv") else args.ratios):
                row, _ = run(model, tok, anchorkv, context, data, prompt, generated, key, method, ratio, args)
                row.update(trial=trial, key=key)
                rows.append(row)
                log(json.dumps(row))
    if args.csv:
        fields = sorted({k for row in rows for k in row})
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
