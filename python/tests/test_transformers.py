"""anchorkv.transformers on a small random Llama (no download): the compressed decode through
the whole model equals transformers' SDPA over what the caches represent (reconstructed K/V in
a DynamicCache), for batch 1 and a batch of equal-length prompts; FullKV follows the exact
cache; enable()/AnchorKVPress install and restore; torch tensors through Cache.decode(lse=).
Skips without torch and transformers (CI installs them: scripts/install-deps.sh)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import anchorkv  # noqa: E402
import anchorkv.transformers as akv_hf  # noqa: E402


def _fresh_seed():
    return int(np.random.SeedSequence().entropy % (1 << 31))


@pytest.fixture
def model():
    seed = _fresh_seed()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         max_position_embeddings=4096, rope_theta=10000.0)
    model = LlamaForCausalLM(config).eval()
    model.seed = seed
    return model


def _reference_cache(cache: akv_hf.AnchorKVCache) -> DynamicCache:
    """A DynamicCache holding exactly what every layer's compressed caches represent."""
    data = []
    for layer in cache.layers:
        keys, values = [], []
        for row in layer.caches:
            k, v, present = row.reconstruct(rotated=True)
            # Evicted tokens are absent (SnapKV keeps the same count in every head).
            keys.append(torch.from_numpy(np.stack([k[h][present[h] == 1] for h in range(k.shape[0])])))
            values.append(torch.from_numpy(np.stack([v[h][present[h] == 1] for h in range(v.shape[0])])))
        data.append((torch.stack(keys), torch.stack(values)))
    return DynamicCache(ddp_cache_data=data)


@pytest.mark.parametrize("batch", [1, 2])
# logit_correction 0: SDPA over the reconstruction is then the decode exactly (the correction's
# share is tested against Cache.logit_penalty in test_numpy.py and test_lse.py).
@pytest.mark.parametrize("method, options", [("anchorkv", {"retain_fraction": 0.4, "logit_correction": 0.0}),
                                             ("snapkv", {"retain_fraction": 0.5})])
def test_decode_equals_sdpa_over_the_reconstructed_caches(model, batch, method, options):
    akv_hf.enable(model)
    generator = torch.Generator().manual_seed(model.seed)
    prompt = torch.randint(0, 256, (batch, 300), generator=generator)
    steps = torch.randint(0, 256, (batch, 4), generator=generator)
    cache = akv_hf.AnchorKVCache(model, method=method, **options)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache)
        assert all(layer.caches and len(layer.caches) == batch for layer in cache.layers)
        assert cache.full_bytes / cache.compressed_bytes > 1.5
        # One token, then three at once (q_len 3: causal among them), each against SDPA over
        # the reconstructed K/V plus the same new tokens.
        for chunk in (steps[:, :1], steps[:, 1:]):
            reference = _reference_cache(cache)
            # Positions continue the prompt's (an evicting cache holds fewer tokens).
            past = cache.get_seq_length()
            positions = torch.arange(past, past + chunk.shape[1]).expand(batch, -1)
            expected = model(input_ids=chunk, cache=reference, position_ids=positions).logits
            got = model(input_ids=chunk, cache=cache).logits
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"seed {model.seed}: {m}")
    assert cache.get_seq_length() == 304
    cache.close()


def test_fullkv_follows_the_exact_cache_and_generate_runs(model):
    generator = torch.Generator().manual_seed(model.seed)
    prompt = torch.randint(0, 256, (2, 120), generator=generator)
    nxt = torch.randint(0, 256, (2, 1), generator=generator)
    with torch.no_grad():
        exact = DynamicCache(config=model.config)
        model(input_ids=prompt, cache=exact)
        expected = model(input_ids=nxt, cache=exact).logits
        handle = akv_hf.enable(model, method="fullkv")
        cache = handle.new_cache()
        model(input_ids=prompt, cache=cache)
        got = model(input_ids=nxt, cache=cache).logits
        # FullKV stores K/V in bf16 (relative rounding 2^-9): logits moved by 2.3e-4 (measured;
        # the cache of another prompt moves them by 0.67, at logits of size 0.67).
        torch.testing.assert_close(got, expected, rtol=0, atol=3e-3,
                                   msg=lambda m: f"seed {model.seed}: {m}")
        out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 125)
    handle.disable()


def test_enable_and_press_install_and_restore(model):
    assert model.config._attn_implementation != akv_hf.ATTENTION_NAME
    before = model.config._attn_implementation
    with akv_hf.AnchorKVPress(compression_ratio=0.6)(model) as handle:
        assert model.config._attn_implementation == akv_hf.ATTENTION_NAME
        assert handle.options["retain_fraction"] == pytest.approx(0.4)
        cache = handle.new_cache()
        prompt = torch.randint(0, 256, (1, 300))
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=2, do_sample=False, cache=cache)
        assert 2.0 < cache.full_bytes / cache.compressed_bytes < 2.6
        with pytest.raises(ValueError, match="left-padded"):  # right padding: refused before any forward
            mask = torch.ones(2, 300, dtype=torch.long)
            mask[0, -1] = 0
            model.generate(torch.randint(0, 256, (2, 300)), attention_mask=mask, max_new_tokens=1)
    assert model.config._attn_implementation == before
    assert "generate" not in vars(model)


def test_lse_with_torch_tensors(model):
    seed = model.seed
    rng = np.random.default_rng(seed)
    keys = torch.from_numpy(rng.standard_normal((2, 256, 64), dtype=np.float32))
    values = torch.from_numpy(rng.standard_normal((2, 256, 64), dtype=np.float32))
    window = torch.from_numpy(rng.standard_normal((4, 32, 64), dtype=np.float32))
    cache = anchorkv.compress(keys, values, window, retain_fraction=0.3)
    query = torch.from_numpy(rng.standard_normal((4, 2, 64), dtype=np.float32))
    cache.append(torch.randn(2, 1, 64), torch.randn(2, 1, 64))
    out, lse = cache.decode(query, lse=True)
    assert isinstance(lse, torch.Tensor) and lse.shape == (4, 2) and lse.dtype == torch.float32
    k, v, _ = cache.reconstruct(rotated=True)
    kk = torch.from_numpy(k).double().repeat_interleave(2, dim=0)
    logits = torch.einsum("hqd,htd->hqt", query.double(), kk) / 8.0
    penalty = torch.from_numpy(cache.logit_penalty()).double().repeat_interleave(2, dim=0)  # [Hq][T]
    logits -= penalty[:, None, :] * (query.double() ** 2).sum(-1, keepdim=True) / 64.0
    logits[:, 0, -1] = -float("inf")  # the first query does not see the second's token
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, dim=-1), rtol=1e-5, atol=1e-4,
                               msg=lambda m: f"seed {seed}: {m}")


def test_budget_is_checked_before_the_prefill(model):
    """A retain_fraction too small for the prompt: clamped with a warning before any compute
    (default), or BudgetError before any forward (on_budget="raise")."""
    prompt = torch.randint(0, 256, (1, 200))
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    handle = akv_hf.enable(model, retain_fraction=0.01, on_budget="raise")
    try:
        with pytest.raises(anchorkv.BudgetError):
            model.generate(prompt, max_new_tokens=1, do_sample=False)
        assert not forwards  # refused before the prefill
    finally:
        handle.disable()
    handle = akv_hf.enable(model, retain_fraction=0.01)
    try:
        cache = handle.new_cache()
        with pytest.warns(UserWarning, match="cannot hold a 200-token prompt"), torch.no_grad():
            model.generate(prompt, max_new_tokens=2, do_sample=False, cache=cache)
        smallest = anchorkv.smallest_retain_fraction(200, 2, 32, num_q_heads=4, window=32)
        assert cache.full_bytes / cache.compressed_bytes == pytest.approx(1.0 / smallest, rel=0.05)
    finally:
        handle.disable()


def test_cache_works_without_enable(model):
    """An AnchorKVCache passed to generate() on its own compresses (it sets the attention
    implementation), and the tokens equal those of enable() with the same options."""
    prompt = torch.randint(0, 256, (1, 300))
    assert model.config._attn_implementation != akv_hf.ATTENTION_NAME
    cache = akv_hf.AnchorKVCache(model, retain_fraction=0.4)
    with torch.no_grad():
        alone = model.generate(prompt, max_new_tokens=3, do_sample=False, cache=cache)
    assert cache.compressed_bytes > 0 and cache.full_bytes / cache.compressed_bytes > 2.0
    handle = akv_hf.enable(model, retain_fraction=0.4)
    try:
        with torch.no_grad():
            enabled = model.generate(prompt, max_new_tokens=3, do_sample=False)
    finally:
        handle.disable()
    assert torch.equal(alone, enabled)


def _left_padded(prompts: list[torch.Tensor]):
    """input_ids, attention_mask and generate()'s position_ids of left-padded prompts."""
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.numel():] = p
        mask[row, width - p.numel():] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.mark.parametrize("method, options", [("fullkv", {}),
                                             ("anchorkv", {"retain_fraction": 0.4, "logit_correction": 0.0})])
def test_left_padded_batch_compresses_each_prompt_without_its_padding(model, method, options):
    """Prompts of 300, 170 and 60 tokens, left-padded into one batch: each row's cache holds
    its own prompt (the padding dropped; 60 <= 2 * window stays exact) at generate()'s
    positions, and the next token's logits equal each prompt run alone: against the exact
    cache (FullKV), or against SDPA over what the row's cache represents (AnchorKV)."""
    generator = torch.Generator().manual_seed(model.seed)
    lengths = [300, 170, 60]
    prompts = [torch.randint(0, 256, (n,), generator=generator) for n in lengths]
    nxt = torch.randint(0, 256, (len(lengths), 1), generator=generator)
    ids, mask, positions = _left_padded(prompts)
    cache = akv_hf.AnchorKVCache(model, method=method, **options)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache)
        for layer in cache.layers:
            assert [row.shape.seq_len for row in layer.caches] == lengths
        references = []
        for row, n in enumerate(lengths):
            if method == "fullkv":
                reference = DynamicCache(config=model.config)
                model(input_ids=prompts[row][None], cache=reference)
            else:  # what the row's caches represent, taken before the decode appends to them
                alone = akv_hf.AnchorKVCache(model, method=method, **options)
                for mine, theirs in zip(alone.layers, cache.layers):
                    mine.caches = [theirs.caches[row]]
                reference = _reference_cache(alone)
            references.append(reference)
        got = model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones_like(nxt)], dim=1),
                    position_ids=torch.tensor(lengths)[:, None], cache=cache).logits
        for row, n in enumerate(lengths):
            expected = model(input_ids=nxt[row][None], cache=references[row],
                             position_ids=torch.tensor([[n]])).logits
            # FullKV stores K/V in bf16 (see test_fullkv_follows_the_exact_cache_and_generate_runs).
            torch.testing.assert_close(got[row], expected[0], rtol=0, atol=3e-3 if method == "fullkv" else 1e-4,
                                       msg=lambda m: f"seed {model.seed}, row {row}: {m}")
    stats = [row.stats for row in cache.layers[0].caches]
    if method == "anchorkv":
        assert stats[0].ratio > 2.0 and stats[1].ratio > 2.0 and stats[2].method == anchorkv.Method.FULLKV
    cache.close()


def test_left_padded_generate(model):
    """generate() with a left-padded batch through enable(): each row's greedy tokens and
    per-step logits equal those of its prompt generated alone (FullKV; exact up to bf16
    storage). A random model's greedy choice can be a near-tie that bf16 rounding flips; the
    rows are compared step by step until the first such tie, which must be one. EOS is
    suppressed for the 4 steps (a random model may draw it, ending one generation early)."""
    generator = torch.Generator().manual_seed(model.seed)
    prompts = [torch.randint(0, 256, (n,), generator=generator) for n in (200, 130)]
    ids, mask, _ = _left_padded(prompts)
    greedy = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    eos = model.generation_config.eos_token_id
    handle = akv_hf.enable(model, method="fullkv")
    try:
        with torch.no_grad():
            batch = model.generate(ids, attention_mask=mask, **greedy)
            alone = [model.generate(p[None], **greedy) for p in prompts]
    finally:
        handle.disable()
    assert batch.sequences.shape == (2, 204)
    atol = 3e-3
    for row, single in enumerate(alone):
        assert single.sequences.shape == (1, prompts[row].numel() + 4)
        for step in range(4):
            got, expected = batch.logits[step][row], single.logits[step][0]
            torch.testing.assert_close(got, expected, rtol=0, atol=atol,
                                       msg=lambda m: f"seed {model.seed}, row {row}, step {step}: {m}")
            mine, theirs = batch.sequences[row, 200 + step], single.sequences[0, -4 + step]
            if mine != theirs:  # only a tie within the tolerance may choose differently
                ranked = expected.clone()
                if eos is not None:
                    ranked[eos] = -float("inf")  # min_new_tokens masks it in the greedy choice
                top2 = ranked.topk(2).values
                assert top2[0] - top2[1] <= 2 * atol, f"seed {model.seed}, row {row}, step {step}"
                break