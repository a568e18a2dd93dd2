#!/usr/bin/env python3
"""NVIDIA KVPress's presses on passkey.py's prompts, for the same table as passkey.py's rows.

KVPress (PyPI `kvpress`) pins transformers below 5.3; this script runs its presses on the
transformers installed here through a thin shim (transformers 5.3 renamed the attention's
`past_key_values` argument to `cache` and dropped `cache_position`). Make kvpress importable
first, for example:

    pip download kvpress==0.5.5 --no-deps -d /tmp/kvp && unzip -q /tmp/kvp/kvpress-*.whl -d /tmp/kvp/src
    pip install --target /tmp/kvp/deps "cachetools<6" fire
    passkey_kvpress.py --kvpress-path /tmp/kvp/src /tmp/kvp/deps --haystack prose --trials 10

(`datasets`, which only DuoAttentionPress needs, is stubbed when missing.) Per trial: one
prefill with transformers' DynamicCache recording each attention layer's inputs; then per
press and ratio, press.compress() on every layer's keys and values (what the press's forward
hook does at the end of prefill), the answer prefix fed at the prompt's next positions, and
greedy decoding. compression_ratio = 1 - 1/ratio (the share removed), so the kept tokens match
anchorkv's retain_fraction in bytes. `hf-full` is the uncompressed cache.
"""
from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import passkey  # noqa: E402
import passkey_transformers  # noqa: E402
import smollm2  # noqa: E402

PRESSES = ["TOVAPress", "SnapKVPress", "KnormPress", "StreamingLLMPress", "ExpectedAttentionPress"]


def import_kvpress(paths):
    sys.path[:0] = [str(p) for p in paths]
    try:
        import datasets  # noqa: F401
    except ImportError:  # only DuoAttentionPress loads a dataset
        stub = types.ModuleType("datasets")
        stub.load_dataset = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("datasets is not installed"))
        sys.modules["datasets"] = stub
    import kvpress
    return kvpress


def prefill_recording(model, tokens):
    """The prompt's forward with a DynamicCache; per attention layer, the keyword arguments its
    forward got (hidden states, position embeddings, ...) and its output."""
    import torch
    from transformers import DynamicCache
    records, handles = {}, []
    for layer in model.model.layers:
        def hook(module, args, kwargs, output, index=layer.self_attn.layer_idx):
            records[index] = (dict(kwargs), output)
        handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tokens]), cache=cache, use_cache=True, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    return cache, records


def compressed_cache(model, press, full_cache, records):
    """What the press's forward hook leaves in the cache at the end of prefill."""
    import torch
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    press.post_init_from_model(model)  # what press(model) does before hooking the layers
    with torch.no_grad():
        for layer in model.model.layers:
            module = layer.self_attn
            module.rotary_emb = model.model.rotary_emb
            kwargs, output = records[module.layer_idx]
            kwargs = dict(kwargs)
            q_len = kwargs["hidden_states"].shape[1]
            kwargs.setdefault("past_key_values", kwargs.get("cache"))
            kwargs.setdefault("cache_position", torch.arange(q_len))
            keys = full_cache.layers[module.layer_idx].keys
            values = full_cache.layers[module.layer_idx].values
            keys, values = press.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
            cache.update(keys.contiguous(), values.contiguous(), module.layer_idx)
    return cache


def greedy(model, tok, cache, start, forced, max_new):
    """Feed the forced prefix at positions start.., then greedy tokens (the prompt's positions
    continue even though the cache holds fewer tokens)."""
    import torch
    out, position = [], start
    with torch.no_grad():
        feed = list(forced)
        for _ in range(max_new + 1):
            ids = torch.tensor([feed])
            positions = torch.arange(position, position + len(feed))[None]
            logits = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                           logits_to_keep=1).logits[0, -1]
            position += len(feed)
            token = int(torch.argmax(logits))
            out.append(token)
            if token in tok.stop_ids or len(out) >= max_new:
                break
            feed = [token]
    while out and out[-1] in tok.stop_ids:
        out.pop()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvpress-path", nargs="*", default=[], help="folders to put first on sys.path")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20])
    parser.add_argument("--presses", nargs="+", default=PRESSES)
    parser.add_argument("--haystack", choices=passkey.HAYSTACKS, default="prose")
    parser.add_argument("--answer-prefix", default="The pass key is ")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    kvpress = import_kvpress(args.kvpress_path)
    model, tok = passkey_transformers.load_hf_model(), smollm2.load_tokenizer()
    depths = passkey.default_depths(args.trials)
    results = {}
    for length in args.lengths:
        for trial in range(args.trials):
            depth = passkey.trial_depth(depths, trial)
            key = passkey.trial_key(args.seed, length, trial)
            prompt = passkey.build_prompt(tok, length, key, depth, False, args.answer_prefix, args.haystack,
                                          args.seed, trial)
            started = time.time()
            full, records = prefill_recording(model, prompt.tokens)
            prefill_s = time.time() - started
            rows = [("hf-full", None, full)]
            for name in args.presses:
                for ratio in args.ratios:
                    press = getattr(kvpress, name)(compression_ratio=1.0 - 1.0 / ratio)
                    rows.append((name, ratio, compressed_cache(model, press, full, records)))
            for name, ratio, cache in rows:
                tokens = greedy(model, tok, cache, length, prompt.forced, passkey.MAX_NEW)
                text = tok.decode(tokens)
                correct = passkey.answer_of(text, prompt) == prompt.answer
                results.setdefault((name, ratio, length), []).append(correct)
                print(f"L={length} t{trial} key {key} depth {depth:.2f} {name:>22} {passkey._fmt_ratio(ratio):>4}: "
                      f"{'ok ' if correct else 'BAD'} kept {cache.get_seq_length()} {text!r}", file=sys.stderr, flush=True)
            print(f"L={length} t{trial}: prefill {prefill_s:.1f} s, all rows {time.time() - started:.1f} s",
                  file=sys.stderr, flush=True)
    try:
        from importlib.metadata import version
        kvpress_version = version("kvpress")
    except Exception:  # noqa: BLE001 - a source tree without metadata
        kvpress_version = "?"
    print(f"\ncorrect / trials (KVPress {kvpress_version}, haystack {args.haystack}; hf-full: the uncompressed cache)")
    print(f"{'':>28}" + "".join(f"{f'{l // 1024}K/{passkey._fmt_ratio(r)}':>10}" for l in args.lengths
                                 for r in args.ratios))
    for name in ["hf-full"] + args.presses:
        line = f"{name:>28}"
        for length in args.lengths:
            for ratio in args.ratios:
                if name == "hf-full" and ratio != args.ratios[0]:
                    line += f"{'':>10}"
                    continue
                cell = results.get((name, None if name == "hf-full" else ratio, length), [])
                line += f"{f'{sum(cell)}/{len(cell)}':>10}"
        print(line)


if __name__ == "__main__":
    main()
