#!/usr/bin/env python3
"""Pass-key retrieval with SmolLM2-135M-Instruct (numpy) and anchorkv's compressed caches.

A prompt of filler sentences with the needle "IMPORTANT: The pass key is NNNNN. Remember it."
at a depth, then "What is the pass key?" in the chat template. After a numpy prefill, every
layer's K/V (and the post-RoPE queries of the last window positions) go to
anchorkv.Context.compress; the answer prefix "The pass key is" (unless --prefix-in-prompt)
and up to 8 greedy tokens then run through Cache.append / Cache.decode. A trial is correct
when the first 5-digit number of the output equals the key.

Per (length, trial, method, ratio) it also measures the teacher-forced mean log-probability
of the key's digit tokens after the answer prefix (one decode call with q_len = prefix +
digits) and compares it, and the generated tokens, with the exact numpy full cache.

Each trial's prefill (K/V/Qwin of every layer, tokens, the numpy full-cache answer) is cached
under --cache-dir, so every method reuses it and a second run does no prefill.

    passkey.py --lengths 2048 4096 8192 --trials 10 \
        --methods fullkv anchorkv snapkv adakv pyramidkv andpro --ratios 5 10 20 --csv out.csv
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2  # noqa: E402

FILLER = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again."]
# The repeated unit above, or distinct generated sentences; "prose-multikey": prose with four
# needles, one per door colour, and the question asks for one door's key; "prose-word": prose
# with a word to remember instead of a number (the answer prefix's "pass key" becomes "secret
# word"), drawn from _WORDS by the trial's key; "prose-chain": RULER's variable tracking on
# prose, two chains of two hops ("VAR QZT = 12345." ... "VAR MKB = VAR QZT."), the question
# asks for the value of one chain's last variable.
HAYSTACKS = ("repeat", "prose", "prose-multikey", "prose-word", "prose-chain")
_DOORS = ["red", "green", "blue", "yellow"]
_WORDS = ["tangerine", "saxophone", "glacier", "walnut", "harpoon", "tulip", "compass", "origami", "volcano",
          "penguin", "cathedral", "marmalade", "cactus", "parsley", "hurricane", "igloo", "kangaroo", "pelican",
          "lighthouse", "cinnamon", "trombone", "avalanche", "pumpkin", "flamingo"]

# "prose": distinct sentences from templates, drawn with a seed per (length, trial); no
# sentence and no short unit repeats, so no few anchors can stand for the haystack.
_NAMES = ["Maria", "the old baker", "a young engineer", "Thomas", "the harbour master", "Aiko", "the mayor",
          "a retired teacher", "Lukas", "the night nurse", "Fatima", "the gardener", "an apprentice", "Omar",
          "the librarian", "Ines", "a travelling musician", "the ferryman", "Priya", "the village doctor"]
_VERBS = ["repaired", "painted", "sold", "carried", "found", "borrowed", "described", "measured", "cleaned",
          "photographed", "forgot", "ordered", "built", "inspected", "returned", "hid", "weighed", "wrapped"]
_ADJS = ["wooden", "rusty", "narrow", "bright", "heavy", "crooked", "silver", "dusty", "enormous", "tiny",
         "striped", "broken", "fragrant", "ancient", "polished", "folded", "damp", "hollow"]
_NOUNS = ["ladder", "bicycle", "lantern", "chair", "boat", "clock", "kettle", "map", "violin", "basket",
          "window frame", "telescope", "wheelbarrow", "piano", "umbrella", "fishing net", "cabinet", "bell"]
_PLACES = ["behind the station", "near the river", "in the market square", "at the edge of the forest",
           "beside the chapel", "under the bridge", "on the hill road", "inside the warehouse",
           "next to the school", "by the harbour wall", "in the courtyard", "at the crossroads"]
_TIMES = ["on a cold Tuesday", "before dawn", "after the storm", "late in the summer", "during the festival",
          "one quiet evening", "at noon", "in early spring", "the day before the election", "last winter"]
_FRAMES = ["{time}, {name} {verb} a {adj} {noun} {place}.",
           "{name} {verb} the {adj} {noun} {place} {time}.",
           "Nobody expected that {name} {verb} a {adj} {noun} {time}.",
           "{place_cap}, {name} once {verb} a {adj} {noun}.",
           "It was {time} when {name} {verb} the {noun}, which was {adj}.",
           "According to the neighbours, {name} {verb} a {adj} {noun} {place}."]


def prose_sentences(seed: int, length: int, trial: int, count: int) -> list[str]:
    """`count` distinct template sentences for a trial (deterministic)."""
    rng = np.random.default_rng([seed, length, trial, 7])
    out, seen = [], set()
    while len(out) < count:
        pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
        place = pick(_PLACES)
        s = pick(_FRAMES).format(time=pick(_TIMES), name=pick(_NAMES), verb=pick(_VERBS), adj=pick(_ADJS),
                                 noun=pick(_NOUNS), place=place, place_cap=place[0].upper() + place[1:])
        s = s[0].upper() + s[1:]
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out
INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and "
               "memorize it. I will quiz you about the important information there.")
QUESTION = "What is the pass key?"
# The trailing space forces the space token before the digits: without it the 135M model often
# continues "The pass key is a unique identifier..." although it knows the digits.
PREFIX = "The pass key is "
FIRST_PREFIX = "The pass key is"  # the prefix of the first cache version (meta.json references)
MAX_NEW = 8
PREFILL_FORMAT = 1  # bump when the cached prefill layout changes
AKV_WINDOW = 32
METHODS = ("fullkv", "anchorkv", "snapkv", "adakv", "pyramidkv", "andpro", "tova", "knorm", "streamingllm")


def log(*args):
    print(*args, file=sys.stderr, flush=True)


# ---- Prompts ---------------------------------------------------------------------------------

def trial_key(seed: int, length: int, trial: int) -> int:
    """The 5-digit key of a trial: depends only on (seed, length, trial)."""
    return int(np.random.default_rng([seed, length, trial, 1]).integers(10000, 100000))


def default_depths(trials: int) -> list[float]:
    return [0.5] if trials == 1 else list(np.linspace(0.05, 0.95, trials))


def trial_depth(depths, trial: int) -> float:
    return float(depths[trial % len(depths)])


@dataclass
class Prompt:
    tokens: list[int]
    key: int
    depth: float
    needle_start: int        # token index of the needle
    forced: list[int]        # answer prefix fed after compression ([] with the prefix in the prompt)
    tf_tokens: list[int]     # forced + " NNNNN": the teacher-forced continuation
    digit_index: list[int]   # indices into tf_tokens of the key's digits (of the word's tokens)
    answer: str = ""         # the expected answer: the key's digits, or the word


def build_prompt(tok, length: int, key: int, depth: float, prefix_in_prompt: bool,
                 answer_prefix: str = PREFIX, haystack: str = "repeat", seed: int = 0, trial: int = 0) -> Prompt:
    """Exactly `length` tokens: chat template, instruction, filler with the needle at `depth`
    (a fraction of the filler, at a sentence boundary), the question. haystack "repeat"
    cycles FILLER; "prose" uses distinct template sentences (prose_sentences);
    "prose-multikey" adds three needles of other doors (their keys seeded per trial) a quarter
    of the filler apart, and asks for the key of one door (by trial); "prose-chain" states
    the key in one variable and copies it to a second one later in the text, a second chain
    with another key in between (names and key seeded per trial), and asks for the value of
    the asked chain's second variable (the needle is the first statement)."""
    head = tok.encode(f"<|im_start|>system\n{smollm2.DEFAULT_SYSTEM}<|im_end|>\n"
                      f"<|im_start|>user\n{INSTRUCTION}")
    question, distractors = QUESTION, []  # distractors: (depth, tokens)
    answer_text = str(key)
    if haystack == "prose-word":
        answer_text = _WORDS[key % len(_WORDS)]
        needle = tok.encode(f" IMPORTANT: The secret word is {answer_text}. Remember it.")
        question = "What is the secret word?"
        # A word follows its space in one token, so the prefix stops before the space.
        answer_prefix = answer_prefix.replace("pass key", "secret word").rstrip(" ")
    elif haystack == "prose-multikey":
        door = _DOORS[trial % len(_DOORS)]
        needle = tok.encode(f" IMPORTANT: The pass key of the {door} door is {key}. Remember it.")
        question = f"What is the pass key of the {door} door?"
        rng = np.random.default_rng([seed, length, trial, 7])
        for i, other in enumerate(d for d in _DOORS if d != door):
            other_key = int(rng.integers(10000, 100000))
            distractors.append(((depth + (i + 1) / len(_DOORS)) % 1.0,
                                tok.encode(f" IMPORTANT: The pass key of the {other} door is {other_key}. Remember it.")))
    elif haystack == "prose-chain":
        rng = np.random.default_rng([seed, length, trial, 11])
        names = set()
        while len(names) < 4:
            names.add("".join(chr(ord("A") + int(c)) for c in rng.integers(0, 26, 3)))
        first, second, other_first, other_second = sorted(names, key=lambda n: rng.random())
        other_key = int(rng.integers(10000, 100000))
        # The asked chain's hops at depth/2 and depth/2 + 0.45, the other chain's between and after.
        needle = tok.encode(f" VAR {first} = {key}.")
        distractors = [(depth / 2 + 0.45, tok.encode(f" VAR {second} = VAR {first}.")),
                       (depth / 2 + 0.2, tok.encode(f" VAR {other_first} = {other_key}.")),
                       (depth / 2 + 0.5, tok.encode(f" VAR {other_second} = VAR {other_first}."))]
        question = f"What is the value of VAR {second}?"
        answer_prefix = answer_prefix.replace("pass key", f"value of VAR {second}")
        depth = depth / 2
    else:
        needle = tok.encode(f" IMPORTANT: The pass key is {key}. Remember it.")
    tail = tok.encode(f"\n\n{question}<|im_end|>\n<|im_start|>assistant\n" +
                      (answer_prefix if prefix_in_prompt else ""))
    budget = length - len(head) - len(needle) - len(tail) - sum(len(d) for _, d in distractors)
    if budget < 16:
        raise ValueError(f"length {length} is too short for the pass-key prompt")
    if haystack.startswith("prose"):  # about 12 tokens a sentence: more than enough of them
        sentences = [tok.encode(" " + s) for s in prose_sentences(seed, length, trial, budget // 6 + 8)]
    else:
        sentences = [tok.encode(" " + s) for s in FILLER]
    pieces, total = [], 0
    while total < budget:
        piece = sentences[len(pieces) % len(sentences)]
        pieces.append(piece)
        total += len(piece)
    for where, tokens_d in sorted(distractors, key=lambda d: -d[0]):  # whole, never cut off the end
        pieces.insert(min(int(round(where * len(pieces))), len(pieces) - 2), tokens_d)
        budget += len(tokens_d)
    at = min(int(round(depth * len(pieces))), len(pieces) - 1)
    before = [t for piece in pieces[:at] for t in piece]
    after = [t for piece in pieces[at:] for t in piece][:budget - len(before)]
    tokens = head + before + needle + after + tail
    assert len(tokens) == length, (len(tokens), length)
    # The answer as the model would write it: prefix, one space, the digits (a prefix ending
    # in a space, e.g. "The pass key is ", forces the space token that precedes the digits).
    prefix = tok.encode(answer_prefix)
    answer = tok.encode(answer_prefix + ("" if answer_prefix.endswith(" ") else " ") + answer_text)
    assert answer[:len(prefix)] == prefix, "the answer prefix does not tokenize as a prefix"
    forced = [] if prefix_in_prompt else prefix
    tf_tokens = forced + answer[len(prefix):]
    digit_index = [i for i, t in enumerate(tf_tokens) if i >= len(forced) and
                   (haystack == "prose-word" or tok.decode([t]).strip().isdigit())]
    assert "".join(tok.decode([tf_tokens[i]]).strip() for i in digit_index) == answer_text
    return Prompt(tokens, key, depth, len(head) + len(before), forced, tf_tokens, digit_index, answer_text)


def first_number(text: str) -> int | None:
    match = re.search(r"(?<!\d)\d{5}(?!\d)", text)
    return int(match.group(0)) if match else None


def answer_of(text: str, prompt: Prompt) -> str | None:
    """The answer in a generated text: the first five-digit number, or for a word needle the
    first word (lower case)."""
    if prompt.answer and not prompt.answer.isdigit():
        match = re.search(r"[A-Za-z]+", text)
        return match.group(0).lower() if match else None
    number = first_number(text)
    return None if number is None else str(number)


# ---- Prefill cache -------------------------------------------------------------------------

@dataclass
class TrialData:
    length: int
    trial: int
    prompt: Prompt
    keys: np.ndarray       # [L][H][S][D] pre-RoPE (memory-mapped)
    values: np.ndarray     # [L][H][S][D]
    q_window: np.ndarray   # [L][Hq][64][D] post-RoPE
    logits: np.ndarray     # [vocab] of the last prompt position
    ref_tokens: list[int]  # numpy full-cache greedy answer (after the forced prefix)
    ref_text: str
    ref_logp: list[float]  # numpy full-cache log-probabilities of the key's digits
    prefill_seconds: float
    cached: bool = False


def teacher_forced_logp(model, data_logits, start, attention, prompt: Prompt) -> list[float]:
    """log p of each key digit given everything before it: one step with q_len =
    len(tf_tokens) - 1 (the prediction of tf_tokens[0] comes from the prompt's logits)."""
    feed = prompt.tf_tokens[:-1]
    logits = model.step(feed, np.arange(start, start + len(feed)), attention)
    rows = np.concatenate([data_logits[None, :], logits], 0)  # row j predicts tf_tokens[j]
    logp = smollm2.log_softmax(rows[prompt.digit_index])
    return [float(logp[i, prompt.tf_tokens[j]]) for i, j in enumerate(prompt.digit_index)]


def _trial_dir(cache_dir: Path, length, trial, seed, flavour, tokens) -> Path:
    digest = hashlib.sha1(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:10]
    return (Path(cache_dir) / f"passkey-v{PREFILL_FORMAT}" /
            f"{flavour}-L{length}-s{seed}-t{trial}-{digest}")


def _reference(model, tok, keys, values, logits, prompt: Prompt):
    """The numpy full cache's greedy answer and teacher-forced digit log-probabilities."""
    S = len(prompt.tokens)
    attention = smollm2.NumpyAttention(model, keys, values)
    tokens = smollm2.greedy(model, logits, S, attention, MAX_NEW, tok.stop_ids, forced=prompt.forced)
    del attention
    attention = smollm2.NumpyAttention(model, keys, values)
    logp = teacher_forced_logp(model, logits, S, attention, prompt)
    return dict(forced=prompt.forced, tf_tokens=prompt.tf_tokens, ref_tokens=tokens,
                ref_text=tok.decode(tokens), ref_logp=logp)


def _write_json(path: Path, value):
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def load_trial(model, tok, cache_dir, length, trial, seed, depth, prefix_in_prompt,
               use_cache=True, answer_prefix=PREFIX, haystack="repeat") -> TrialData:
    """The trial's prompt, prefill and numpy full-cache reference, from the cache under
    cache_dir when there (K/V/Qwin memory-mapped), else computed and stored. The prefill is
    keyed by the prompt's tokens; the reference by the answer prefix as well, so runs with
    another --answer-prefix reuse the prefill of the decode flavour."""
    key = trial_key(seed, length, trial)
    prompt = build_prompt(tok, length, key, depth, prefix_in_prompt, answer_prefix, haystack, seed, trial)
    flavour = "prompt" if prefix_in_prompt else "decode"
    use_cache = use_cache and cache_dir is not None
    if not use_cache:
        pre = model.prefill(prompt.tokens)
        ref = _reference(model, tok, pre.keys, pre.values, pre.logits, prompt)
        return TrialData(length, trial, prompt, pre.keys, pre.values, pre.q_window, pre.logits,
                         ref["ref_tokens"], ref["ref_text"], ref["ref_logp"], pre.seconds)
    directory = _trial_dir(cache_dir, length, trial, seed, flavour, prompt.tokens)
    meta_path = directory / "meta.json"
    cached = meta_path.is_file()
    if not cached:
        pre = model.prefill(prompt.tokens)
        tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, array in (("keys", pre.keys), ("values", pre.values), ("q_window", pre.q_window),
                            ("logits", pre.logits)):
            np.save(tmp / f"{name}.npy", array)
        meta = dict(length=length, trial=trial, seed=seed, flavour=flavour, key=key, depth=depth,
                    tokens=prompt.tokens, prefill_seconds=pre.seconds)
        (tmp / "meta.json").write_text(json.dumps(meta))
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
        del pre
    meta = json.loads(meta_path.read_text())
    assert meta["tokens"] == prompt.tokens
    load = lambda name: np.load(directory / f"{name}.npy", mmap_mode="r")  # noqa: E731
    keys, values, q_window, logits = load("keys"), load("values"), load("q_window"), np.asarray(load("logits"))
    digest = hashlib.sha1(json.dumps([prompt.forced, prompt.tf_tokens]).encode()).hexdigest()[:10]
    ref_path = directory / f"reference-{digest}.json"
    if ref_path.is_file():
        ref = json.loads(ref_path.read_text())
    elif "ref_tokens" in meta and answer_prefix == FIRST_PREFIX:  # written by the first version
        ref = meta
    else:
        ref = _reference(model, tok, keys, values, logits, prompt)
        _write_json(ref_path, ref)
    return TrialData(length, trial, prompt, keys, values, q_window, logits, ref["ref_tokens"],
                     ref["ref_text"], ref["ref_logp"], meta["prefill_seconds"], cached)


# ---- Methods ---------------------------------------------------------------------------------

@dataclass
class Spec:
    label: str              # row of the table: method or variant name
    method: str
    ratio: float | None     # None: FullKV / the numpy reference (no compression)
    options: dict = field(default_factory=dict)

    @property
    def retain_fraction(self):
        return None if self.ratio is None else 1.0 / self.ratio


def parse_value(text: str):
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def parse_options(items) -> dict:
    options = {}
    for item in items:
        if "=" not in item:
            raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
        name, value = item.split("=", 1)
        options[name.strip()] = parse_value(value.strip())
    return options


def parse_variant(text: str):
    if ":" not in text:
        raise argparse.ArgumentTypeError(f"--variant expects NAME:KEY=VALUE,...; got {text!r}")
    name, rest = text.split(":", 1)
    return name.strip(), parse_options([p for p in rest.split(",") if p.strip()])


def method_window(anchorkv, method: str, options: dict) -> int:
    """Observation-window rows the method uses: AnchorKV 32, the others their own default
    (akv_compress_options_init_method: SnapKV/PyramidKV/AdaKV 64, AnDPro 32)."""
    if "window" in options:
        return int(options["window"])
    if method == "anchorkv":
        return AKV_WINDOW
    struct, _ = anchorkv.compress_options(method=method)
    return int(struct.window)


def compress_layers(anchorkv, context, model, data: TrialData, spec: Spec):
    config = model.config
    options = dict(spec.options)
    options.pop("method", None)
    # key_space=post (an experiment, docs/design.md §4.6): the keys handed rotated and the cache
    # told there is no RoPE, so that anchors and residuals are fitted after the rotation
    # (LibraryAttention rotates the appended keys likewise).
    post = options.pop("key_space", "pre") == "post"
    caches = []
    try:
        for layer in range(config.layers):
            if spec.method == "fullkv":
                queries = None
            else:
                window = method_window(anchorkv, spec.method, options)
                queries = data.q_window[layer][:, data.q_window.shape[2] - window:]
                options["window"] = window
            keys = model.rope.apply(np.asarray(data.keys[layer], np.float32), np.arange(data.length)) \
                if post else data.keys[layer]
            caches.append(context.compress(
                keys, data.values[layer], queries, method=spec.method,
                num_q_heads=config.q_heads, retain_fraction=spec.retain_fraction,
                rope_style="none" if post else "gptj",
                rope_base=config.rope_base, layer_index=layer, layer_count=config.layers,
                **options))
    except BaseException:
        for cache in caches:
            cache.close()
        raise
    return caches


def evaluate(anchorkv, context, model, tok, data: TrialData, spec: Spec) -> dict:
    """One (trial, method, ratio): greedy answer and teacher-forced digit log-probabilities."""
    S = data.length
    started = time.time()
    if spec.method == "numpy":  # computed with the prefill (and cached with it)
        tokens, logp = data.ref_tokens, data.ref_logp
        compress_seconds, full_bytes, compressed_bytes = 0.0, 0, 0
    else:
        try:
            caches = compress_layers(anchorkv, context, model, data, spec)
        except anchorkv.BudgetError as error:  # the ratio is out of the method's reach
            return dict(label=spec.label, method=spec.method, ratio=spec.ratio,
                        retain_fraction=spec.retain_fraction,
                        options=";".join(f"{k}={v}" for k, v in spec.options.items()),
                        correct="", answer="", text=f"BudgetError: {error}", same_tokens="",
                        logp="", ref_logp=float(np.mean(data.ref_logp)), dlogp="",
                        full_bytes="", compressed_bytes="", actual_ratio="",
                        compress_s=round(time.time() - started, 3),
                        total_s=round(time.time() - started, 3))
        compress_seconds = time.time() - started
        stats = [cache.stats for cache in caches]
        full_bytes = sum(s.full_bytes for s in stats)
        compressed_bytes = sum(s.compressed_bytes for s in stats)
        blobs = [cache.to_bytes() for cache in caches]  # a pristine copy for teacher forcing
        rope = model.rope if spec.options.get("key_space") == "post" else None  # as compress_layers
        attention = smollm2.LibraryAttention(caches, rope)
        try:
            tokens = smollm2.greedy(model, data.logits, S, attention, MAX_NEW, tok.stop_ids,
                                    forced=data.prompt.forced)
        finally:
            attention.close()
        attention = smollm2.LibraryAttention([context.deserialize(blob) for blob in blobs], rope)
        del blobs
        try:
            logp = teacher_forced_logp(model, data.logits, S, attention, data.prompt)
        finally:
            attention.close()
    text = tok.decode(tokens)
    answer = answer_of(text, data.prompt)
    return dict(
        label=spec.label, method=spec.method,
        ratio="" if spec.ratio is None else spec.ratio,
        retain_fraction="" if spec.retain_fraction is None else spec.retain_fraction,
        options=";".join(f"{k}={v}" for k, v in spec.options.items()),
        correct=int(answer == data.prompt.answer), answer=answer if answer is not None else "",
        text=text, same_tokens=int(tokens == data.ref_tokens),
        logp=float(np.mean(logp)), ref_logp=float(np.mean(data.ref_logp)),
        dlogp=float(np.mean(logp) - np.mean(data.ref_logp)),
        full_bytes=full_bytes, compressed_bytes=compressed_bytes,
        actual_ratio=(full_bytes / compressed_bytes) if compressed_bytes else "",
        compress_s=round(compress_seconds, 3), total_s=round(time.time() - started, 3))


def build_specs(methods, ratios, options, variants, with_numpy=True) -> list[Spec]:
    specs = [Spec("numpy-full", "numpy", None)] if with_numpy else []
    for method in methods:
        if method == "fullkv":
            specs.append(Spec("fullkv", "fullkv", None))
            continue
        for ratio in ratios:
            specs.append(Spec(method, method, ratio, dict(options) if method == "anchorkv" else {}))
    for name, extra in variants:  # --option applies to the AnchorKV ones
        method = str(extra.get("method", "anchorkv")).lower()
        merged = {**(options if method == "anchorkv" else {}), **extra}
        for ratio in ratios:
            specs.append(Spec(name, method, ratio, merged))
    return specs


# ---- Report ----------------------------------------------------------------------------------

def _fmt_ratio(ratio):
    return "1x" if ratio in ("", None) else f"{float(ratio):g}x"


def print_tables(rows, lengths, stream=sys.stdout):
    labels = list(dict.fromkeys(r["label"] for r in rows))
    columns = []
    for length in lengths:
        for ratio in dict.fromkeys(_fmt_ratio(r["ratio"]) for r in rows if r["length"] == length):
            columns.append((length, ratio))
    cells = {}
    for r in rows:
        cells.setdefault((r["label"], r["length"], _fmt_ratio(r["ratio"])), []).append(r)
    width = max(12, max(len(l) for l in labels) + 1)

    def table(title, render):
        print(f"\n{title}", file=stream)
        header = f"{'':{width}}" + "".join(
            f"{(f'{l // 1024}K' if l % 1024 == 0 else str(l)) + '/' + c:>11}" for l, c in columns)
        print(header, file=stream)
        for label in labels:
            line = f"{label:{width}}"
            for length, ratio in columns:
                group = cells.get((label, length, ratio))
                line += f"{render(group) if group else '':>11}"
            print(line, file=stream)

    def ran(render):  # cells whose compression failed (budget) show "budget"
        def cell(group):
            done = [r for r in group if r["correct"] != ""]
            return render(done) if done else "budget"
        return cell

    table("correct / trials", ran(lambda g: f"{sum(r['correct'] for r in g)}/{len(g)}"))
    table("mean log p of the key's digits (teacher-forced)",
          ran(lambda g: f"{np.mean([r['logp'] for r in g]):.3f}"))
    table("mean log p minus the numpy full cache's",
          ran(lambda g: f"{np.mean([r['dlogp'] for r in g]):+.3f}"))
    table("greedy tokens equal the numpy full cache's",
          ran(lambda g: f"{sum(r['same_tokens'] for r in g)}/{len(g)}"))


CSV_FIELDS = ["length", "trial", "seed", "flavour", "answer_prefix", "depth", "key", "label", "method", "ratio",
              "retain_fraction", "options", "correct", "answer", "text", "same_tokens", "logp",
              "ref_logp", "dlogp", "full_bytes", "compressed_bytes", "actual_ratio",
              "compress_s", "total_s", "prefill_s"]


def read_csv(path) -> list[dict]:
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            row["length"] = int(row["length"])
            for name in ("correct", "same_tokens"):
                row[name] = int(row[name]) if row[name] != "" else ""
            for name in ("logp", "dlogp"):
                row[name] = float(row[name]) if row[name] != "" else ""
            rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--depths", type=float, nargs="+", default=None,
                        help="needle depths, cycled over the trials (default: evenly spread "
                             "0.05..0.95 over --trials)")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=list(METHODS),
                        help=f"of {', '.join(METHODS)} (the numpy full cache always runs)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[5, 10, 20],
                        help="compression ratios; retain_fraction = 1/ratio")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="compress option for AnchorKV (and the variants); repeatable")
    parser.add_argument("--variant", action="append", default=[], type=parse_variant,
                        metavar="NAME:KEY=VALUE,...",
                        help="an extra AnchorKV row with these options on top of --option "
                             "(method=... picks another method, without --option); repeatable")
    parser.add_argument("--prefix-in-prompt", action="store_true",
                        help=f"put {PREFIX!r} inside the prompt instead of decoding it "
                             "after compression")
    parser.add_argument("--answer-prefix", default=PREFIX,
                        help=f"answer prefix (default {PREFIX!r}; a trailing space forces the space "
                             "token before the digits)")
    parser.add_argument("--csv", default=None, help="one row per (length, trial, method, ratio)")
    parser.add_argument("--cache-dir", default=None,
                        help=f"weights and prefill cache (default {smollm2.default_cache_dir()})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--haystack", choices=HAYSTACKS, default="repeat",
                        help="repeat: the short filler unit cycled (the original test); prose: distinct "
                             "template sentences, none repeated (natural-text fidelity)")
    parser.add_argument("--threads", type=int, default=0, help="anchorkv context threads")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every answer")
    parser.add_argument("--from-csv", default=None, metavar="PATH",
                        help="only print the tables of an earlier run's --csv file")
    args = parser.parse_args(argv)
    if args.from_csv:
        rows = read_csv(args.from_csv)
        print_tables(rows, list(dict.fromkeys(r["length"] for r in rows)))
        return
    for method in args.methods:
        if method not in METHODS:
            parser.error(f"unknown method {method!r}; known: {', '.join(METHODS)}")
    options = parse_options(args.option)
    depths = args.depths or default_depths(args.trials)
    cache_dir = Path(args.cache_dir) if args.cache_dir else smollm2.default_cache_dir()
    flavour = "prompt" if args.prefix_in_prompt else "decode"

    anchorkv = smollm2.import_anchorkv()
    model, tok = smollm2.load_model(cache_dir), smollm2.load_tokenizer(cache_dir)
    specs = build_specs(args.methods, args.ratios, options, args.variant)
    log(f"anchorkv {anchorkv.library_version()} ({anchorkv._capi.library_path}); "
        f"{len(specs)} rows per trial; answer prefix {args.answer_prefix!r} "
        f"{'in the prompt' if args.prefix_in_prompt else 'decoded after compression'}")
    rows = []
    csv_file = open(args.csv, "w", newline="") if args.csv else None
    writer = csv.DictWriter(csv_file, CSV_FIELDS) if csv_file else None
    if writer:
        writer.writeheader()
    spec_seconds: dict = {}
    with anchorkv.Context(num_threads=args.threads) as context:
        for length in args.lengths:
            for trial in range(args.trials):
                depth = trial_depth(depths, trial)
                started = time.time()
                data = load_trial(model, tok, cache_dir, length, trial, args.seed, depth,
                                  args.prefix_in_prompt, answer_prefix=args.answer_prefix,
                                  haystack=args.haystack)
                log(f"L={length} trial {trial}: key {data.prompt.answer} depth {depth:.2f} "
                    f"{'cached prefill' if data.cached else f'prefill {data.prefill_seconds:.1f} s'}"
                    f" (load {time.time() - started:.1f} s); numpy full cache: {data.ref_text!r}")
                for spec in specs:
                    result = evaluate(anchorkv, context, model, tok, data, spec)
                    result.update(length=length, trial=trial, seed=args.seed, flavour=flavour,
                                  answer_prefix=args.answer_prefix,
                                  depth=round(depth, 4), key=data.prompt.key,
                                  prefill_s=round(data.prefill_seconds, 2))
                    rows.append(result)
                    spec_key = (length, spec.label, _fmt_ratio(spec.ratio))
                    spec_seconds[spec_key] = spec_seconds.get(spec_key, 0.0) + result["total_s"]
                    if writer:
                        writer.writerow(result)
                        csv_file.flush()
                    if args.verbose and result["correct"] == "":
                        log(f"  {spec.label:>12} {_fmt_ratio(spec.ratio):>4}: {result['text']}")
                    elif args.verbose:
                        log(f"  {spec.label:>12} {_fmt_ratio(spec.ratio):>4}: "
                            f"{'ok ' if result['correct'] else 'BAD'} logp {result['logp']:.3f} "
                            f"({result['total_s']:.1f} s) {result['text']!r}")
                del data
    if csv_file:
        csv_file.close()
    print_tables(rows, args.lengths)
    log("\ntiming (seconds, summed over trials: compress + decode of the answer + teacher forcing)")
    for length in args.lengths:
        prefill = [r["prefill_s"] for r in rows if r["length"] == length and r["label"] == "numpy-full"]
        log(f"  L={length}: prefill {np.mean(prefill):.1f} s per prompt (when computed)")
        for (l, label, ratio), seconds in spec_seconds.items():
            if l == length:
                log(f"    {label:>12} {ratio:>4}: {seconds:7.1f} s")


if __name__ == "__main__":
    main()
