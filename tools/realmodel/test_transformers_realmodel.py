"""anchorkv.transformers on the real SmolLM2-135M-Instruct, loaded by transformers from the GGUF.

(a) FullKV through AnchorKVCache generates transformers' own DynamicCache's greedy tokens on
    ~1K-token pass-key prompts (passkey.py's prompts, answer prefix decoded after compression);
(b) AnchorKV at 5x answers the key where the DynamicCache does;
(c) the transformers example of docs/engines.md (the block marked <!-- test: python-transformers -->)
    runs and answers its pass key.

Skips without torch, transformers, accelerate, gguf or the GGUF (scripts/install-deps.sh
installs them all).
"""
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import smollm2  # noqa: E402

_missing = smollm2.missing_requirements() + [
    f"python module {m}" for m in ("torch", "transformers", "accelerate")
    if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip("transformers real-model test needs " + ", ".join(_missing), allow_module_level=True)

import passkey  # noqa: E402
import passkey_transformers  # noqa: E402

anchorkv = smollm2.import_anchorkv()
import anchorkv.transformers as akv_hf  # noqa: E402
from transformers import DynamicCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LENGTH = 1024
TRIALS = [(0, 0.5)]  # (trial, depth): the full cache answers it (test_realmodel.py); one keeps CI short


@pytest.fixture(scope="module")
def model():
    model = passkey_transformers.load_hf_model()
    handle = akv_hf.enable(model)
    yield model, smollm2.load_tokenizer()
    handle.disable()


@pytest.mark.parametrize("trial, depth", TRIALS)
def test_fullkv_and_anchorkv_through_transformers(model, trial, depth):
    model, tok = model
    key = passkey.trial_key(0, LENGTH, trial)
    prompt = passkey.build_prompt(tok, LENGTH, key, depth, prefix_in_prompt=False)
    reference, _, _ = passkey_transformers.run_trial(model, tok, prompt, DynamicCache(config=model.config),
                                                    passkey.MAX_NEW)
    assert passkey.first_number(tok.decode(reference)) == key, tok.decode(reference)
    fullkv, _, _ = passkey_transformers.run_trial(model, tok, prompt,
                                                 akv_hf.AnchorKVCache(model, method="fullkv"), passkey.MAX_NEW)
    assert fullkv == reference, (tok.decode(fullkv), tok.decode(reference))
    cache = akv_hf.AnchorKVCache(model, retain_fraction=0.2)
    tokens, _, _ = passkey_transformers.run_trial(model, tok, prompt, cache, passkey.MAX_NEW)
    assert cache.full_bytes / cache.compressed_bytes == pytest.approx(5.0, rel=0.02)
    assert passkey.first_number(tok.decode(tokens)) == key, tok.decode(tokens)


def test_docs_example():
    page = (ROOT / "docs" / "engines.md").read_text()
    match = re.search(r"<!-- test: python-transformers -->\s*```python\n(.*?)```", page, re.S)
    assert match, "no ```python block marked <!-- test: python-transformers --> in docs/engines.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "python")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    result = subprocess.run([sys.executable, "-c", match.group(1)], env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "52817" in result.stdout, result.stdout
