"""anchorkv for Hugging Face transformers (optional: needs torch and transformers).

One call turns compression on for ``model.generate()``::

    import anchorkv.transformers as akv_hf
    akv_hf.enable(model, retain_fraction=0.1)        # AnchorKV at 10x
    output = model.generate(**inputs, max_new_tokens=32)

or, KVPress-style, for a block of code (``compression_ratio`` is the fraction removed)::

    with akv_hf.AnchorKVPress(compression_ratio=0.9)(model):
        output = model.generate(**inputs, max_new_tokens=32)

How it works. ``AnchorKVCache`` is a transformers ``Cache`` of ``AnchorKVLayer`` layers (the
``CacheLayerMixin`` interface). During the prefill (the first forward) a layer keeps its
post-RoPE keys and values; the attention function registered as ``"anchorkv"`` with
``AttentionInterface.register`` computes the prefill's exact attention (SDPA), then compresses
the layer with the last ``window`` post-RoPE queries (anchorkv.Context.compress, one cache per
batch row) and drops the dense tensors. Every later forward appends its keys/values to the
compressed caches and the attention function decodes over them (Context.decode_batch). The
attention function never receives the cache: ``AnchorKVCache.update`` records itself as the
cache of the current forward (thread-local) and the attention function finds the layer there
by ``module.layer_idx``; outside such a cache it is SDPA.

Supported: decoder-only models whose attention modules follow transformers' functional
AttentionInterface with NeoX (rotate-half) RoPE (Llama, Mistral, Qwen2, SmolLM...), batch
size 1 and batches, left-padded where the prompts differ in length (each row's prompt
without its padding is compressed at the row's own positions and budget), torch tensors on
the CPU (CPU context) or on CUDA (CUDA context, when the library is built with CUDA), passed
without copies where their layout allows. Prompts of at most 2 * window tokens are kept
exact (FullKV). Not supported: right padding, chunked prefill, beam search, cropping.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any

import numpy as np

try:
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
except ImportError as _missing:  # the core package works without them; this module does not
    raise ImportError(
        f"anchorkv.transformers needs torch and transformers ({_missing}): "
        "pip install 'anchorkv[transformers]' (or: pip install torch transformers)") from _missing

from ._api import Context, compress_options, fit_budget
from ._enums import Backend, Method

ATTENTION_NAME = "anchorkv"
_current = threading.local()  # .cache: weakref to the AnchorKVCache of this thread's forward


def _exact_attention(module, query, key, value, attention_mask, **kwargs):
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def anchorkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                       **kwargs):
    """The "anchorkv" attention function: query [B][Hq][n][D] post-RoPE; returns
    ([B][n][Hq][D], None) as transformers' attention functions do."""
    ref = getattr(_current, "cache", None)
    cache = ref() if ref is not None else None
    layer = cache.layer_of(module) if cache is not None else None
    # The keys are the very tensor this layer's update returned in this forward (else the
    # forward runs another cache, or none, and the recorded cache is stale).
    if layer is None or layer.returned_keys is not key:
        return _exact_attention(module, query, key, value, attention_mask, scaling=scaling,
                                dropout=dropout, **kwargs)
    layer.returned_keys = None
    if layer.has_pending_prefill:
        pads = left_padding(attention_mask, key.shape[0], key.shape[-2])
        out = _exact_attention(module, query, key, value, attention_mask, scaling=scaling,
                               dropout=dropout, **kwargs)
        layer.compress(query, scaling, pads, kwargs.get("position_ids"))
        return out
    return layer.decode(query), None


_PADDING_HELP = ("anchorkv.transformers takes left-padded batches only (tokenizer(..., padding=True) with "
                 "tokenizer.padding_side = 'left', as transformers recommends for generation)")


def left_padding(attention_mask, batch: int, seq_len: int) -> list[int]:
    """Pad tokens at the start of each batch row of a prefill, from the attention mask its
    attention function receives: [B][1][q][kv] bool (True: attended) or additive float (0:
    attended), or None (no padding). The last query of a row attends to every real token of
    its prompt. Raises ValueError where a row's masked tokens are not all at its start."""
    if attention_mask is None:
        return [0] * batch
    last = attention_mask[:, 0, -1, -seq_len:]
    visible = last if last.dtype == torch.bool else last == 0
    visible = visible.expand(batch, seq_len).cpu()
    pads = (~visible).sum(dim=-1).tolist()
    for row, pad in enumerate(pads):
        if pad == seq_len or not bool(visible[row, pad:].all()):
            raise ValueError(f"{_PADDING_HELP}; row {row} of the batch has masked tokens after its first "
                             "real token (right padding, or a mask that is not causal)")
    return pads


def mask_row_lengths(mask) -> list[int] | None:
    """The prompt length of each row of a [B][S] attention mask (1: token, 0: pad); None
    when it has no padding. Raises ValueError unless the padding is on the left."""
    if mask is None or bool(torch.all(mask != 0)):
        return None
    real = (mask != 0).cpu()
    lengths = real.sum(dim=-1).tolist()
    for row, length in enumerate(lengths):
        if length == 0 or not bool(real[row, real.shape[1] - length:].all()):
            raise ValueError(f"{_PADDING_HELP}; row {row} of attention_mask is "
                             + ("all padding" if length == 0 else "not padded on the left"))
    return lengths


def register() -> None:
    """Register the "anchorkv" attention function and SDPA's masks for it (idempotent): the
    masks serve the SDPA fallback (another cache, a forward after a cached prefix); the
    compressed decode ignores them."""
    AttentionInterface.register(ATTENTION_NAME, anchorkv_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def _rope_options(model) -> dict:
    """The model's RoPE as compress options: NeoX style and its inverse frequencies."""
    rotary = None
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "attention_scaling"):
            rotary = module
            break
    if rotary is None:
        raise ValueError("no rotary embedding module (with inv_freq) found in the model")
    if float(rotary.attention_scaling) != 1.0:
        raise ValueError(f"RoPE with attention_scaling {rotary.attention_scaling} (YaRN-style) is "
                         "not supported")
    inv_freq = rotary.inv_freq.detach().float().cpu().numpy().astype(np.float32)
    return dict(rope_style="neox", rotary_dim=2 * inv_freq.size, inv_freq=inv_freq,
                keys_post_rope=1)


class AnchorKVLayer(CacheLayerMixin):
    """One decoder layer: the prefill's dense K/V until its attention compresses them, then
    one anchorkv.Cache per batch row, to which every later token is appended."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "AnchorKVCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.caches: list | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._length = 0
        self.returned_keys = None  # what update() returned, until the attention call takes it

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    @property
    def has_pending_prefill(self) -> bool:
        return self._pending is not None

    def update(self, key_states, value_states, *args, **kwargs):
        """key_states, value_states: [B][H][n][D], keys post-RoPE."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._pending is not None:
            raise RuntimeError("anchorkv: a second forward reached this layer before the prefill's "
                               "attention compressed it (is the attention implementation "
                               f"{ATTENTION_NAME!r}? anchorkv.transformers.enable(model) sets it)")
        if self.caches is None:
            self._pending = (key_states, value_states)
        else:
            for row, cache in enumerate(self.caches):
                cache.append(key_states[row].contiguous(), value_states[row].contiguous())
        self._length += key_states.shape[-2]
        self.returned_keys = key_states
        return key_states, value_states

    def compress(self, query: torch.Tensor, scaling: float | None, pads: list[int] | None = None,
                 position_ids: torch.Tensor | None = None) -> None:
        """Compress each batch row's prompt: its last seq_len - pads[row] tokens (left padding
        is dropped; the positions are the row's position_ids, which generate() counts from the
        first real token)."""
        keys, values = self._pending
        self._pending = None
        batch, heads, seq_len, head_dim = keys.shape
        context = self.owner.context_for(keys)
        caches = []
        for row in range(batch):
            pad = pads[row] if pads else 0
            options = self.owner.layer_options(self.layer_idx, seq_len - pad, scaling)
            window = options.get("window")
            k, v = keys[row, :, pad:], values[row, :, pad:]
            if k.stride() != v.stride():  # the library takes one stride pair for both
                k, v = k.contiguous(), v.contiguous()
            q = None if window is None else query[row, :, seq_len - window:, :]
            positions = None
            if pad and position_ids is not None:
                ids = position_ids[row if position_ids.shape[0] > 1 else 0, pad:]
                positions = ids.to(device=keys.device, dtype=torch.int32).contiguous()
            caches.append(context.compress(k, v, q, num_q_heads=query.shape[1], positions=positions,
                                           **options))
        self.caches = caches

    def decode(self, query: torch.Tensor) -> torch.Tensor:
        """query [B][Hq][n][D] -> attention output [B][n][Hq][D]."""
        query = query.contiguous()
        if len(self.caches) == 1:
            out = self.caches[0].decode(query[0])[None]
        else:
            out = torch.empty_like(query)
            self.owner.context_for(query).decode_batch(self.caches, query, out=out)
        return out.transpose(1, 2)

    def get_seq_length(self) -> int:
        return self._length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.close()
        self._length = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("anchorkv caches do not support beam search")

    def close(self) -> None:
        for cache in self.caches or ():
            cache.close()
        self.caches = None
        self._pending = None
        self.returned_keys = None

    def stats(self):
        """anchorkv.CacheStats of each batch row (after the prefill)."""
        return [cache.stats for cache in self.caches or ()]


class AnchorKVCache(Cache):
    """A transformers Cache whose layers compress at the end of the prefill.

    options: anchorkv compress options (method="anchorkv", retain_fraction=..., window=...,
    any compress_options field). The model's RoPE, softmax scale, layer index and count are
    filled in. context: an anchorkv.Context; default one per device, made on first use.
    on_budget: when retain_fraction cannot hold a prompt's length (every method keeps some
    tokens exact), "clamp" raises it to the smallest workable fraction with a warning,
    "raise" fails with BudgetError; either before any compute when the prompt length is
    known (generate through enable(), or check_budget(prompt_tokens)).

    Usable on its own: ``model.generate(..., cache=AnchorKVCache(model, ...))``.
    It sets the model's attention implementation to "anchorkv" when it is not (that function
    is SDPA for any forward that does not run an AnchorKVCache).
    """

    def __init__(self, model, *, context: Context | None = None, on_budget: str = "clamp", **options: Any):
        if on_budget not in ("clamp", "raise"):
            raise ValueError(f"on_budget must be 'clamp' or 'raise', not {on_budget!r}")
        config = model.config.get_text_config(decoder=True)
        self.num_layers = config.num_hidden_layers
        super().__init__(layers=[AnchorKVLayer(self, i) for i in range(self.num_layers)])
        self._options = dict(options)
        self._options.setdefault("method", "anchorkv")
        self._rope = _rope_options(model)
        self._context = context
        self._on_budget = on_budget
        self._q_heads = config.num_attention_heads
        self._kv_heads = getattr(config, "num_key_value_heads", None) or self._q_heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // self._q_heads
        self._fitted: dict[int, float] = {}  # prompt length -> retain_fraction every layer uses
        if model.config._attn_implementation != ATTENTION_NAME:
            register()
            model.set_attn_implementation(ATTENTION_NAME)

    def check_budget(self, prompt_tokens: int) -> None:
        """Check, before the prefill, that every layer can compress a prompt of this many
        tokens; clamp retain_fraction (warning once) or raise BudgetError, as on_budget says."""
        if prompt_tokens in self._fitted:
            return
        fraction = self._options.get("retain_fraction")
        for layer in range(self.num_layers):
            options = self.layer_options(layer, prompt_tokens, None, fitted=False)
            if options.get("method") in ("fullkv", Method.FULLKV):
                continue
            if fraction is not None:
                options["retain_fraction"] = fraction
            fitted = fit_budget(prompt_tokens, self._kv_heads, self._head_dim, num_q_heads=self._q_heads,
                                on_budget=self._on_budget, what=f"layer {layer}", **options)
            fraction = fitted.get("retain_fraction", fraction)
        self._fitted[prompt_tokens] = fraction

    # -- what the layers need --
    def context_for(self, tensor: torch.Tensor) -> Context:
        if self._context is None:
            if tensor.device.type == "cuda":
                self._context = Context(Backend.CUDA, device=tensor.device.index or 0)
            else:
                self._context = Context()
        return self._context

    def layer_options(self, layer_idx: int, seq_len: int, scaling: float | None, fitted: bool = True) -> dict:
        if fitted:
            self.check_budget(seq_len)
        options = dict(self._options)
        if fitted and self._fitted.get(seq_len) is not None:
            options["retain_fraction"] = self._fitted[seq_len]
        method = Method.parse(options["method"])
        window = options.get("window")
        if method not in (Method.FULLKV, Method.QUANTIZED):
            if window is None:  # the method's own default window (AnchorKV: 32)
                window = int(compress_options(method=method)[0].window)
            if seq_len <= 2 * window:  # too short to compress: keep it exact
                options = {"method": "fullkv"}
                window = None
        options.update(self._rope, layer_index=layer_idx, layer_count=self.num_layers)
        if scaling is not None:
            options["softmax_scale"] = float(scaling)
        if window is not None:
            options["window"] = window
        else:
            options.pop("window", None)
        return options

    def layer_of(self, module):
        """The layer for an attention module of the forward this cache is running."""
        index = getattr(module, "layer_idx", None)
        if index is None or not 0 <= index < len(self.layers):
            return None
        return self.layers[index]

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        _current.cache = weakref.ref(self)  # the attention function that follows finds its layer here
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def close(self) -> None:
        """Free the compressed caches now (they are also freed when collected)."""
        for layer in self.layers:
            layer.close()
        ref = getattr(_current, "cache", None)
        if ref is not None and ref() is self:
            _current.cache = None

    @property
    def compressed_bytes(self) -> int:
        return sum(s.compressed_bytes for layer in self.layers for s in layer.stats())

    @property
    def full_bytes(self) -> int:
        return sum(s.full_bytes for layer in self.layers for s in layer.stats())


class AnchorKV:
    """What enable() returns: the options, new_cache() and disable()."""

    def __init__(self, model, options: dict, context: Context | None):
        self.model = model
        self.options = options
        self.context = context
        self._previous_attention = None
        self._original_generate = None

    def new_cache(self) -> AnchorKVCache:
        return AnchorKVCache(self.model, context=self.context, **self.options)

    def _install(self) -> None:
        register()
        model = self.model
        self._previous_attention = model.config._attn_implementation
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:
            raise RuntimeError(f"{type(model).__name__} did not accept the attention "
                               f"implementation {ATTENTION_NAME!r}")
        had_own = "generate" in vars(model)
        self._original_generate = (model.generate, had_own)
        original = model.generate

        def generate(*args, **kwargs):
            lengths = mask_row_lengths(kwargs.get("attention_mask"))  # refuses right padding
            cache = kwargs.get("cache")
            if cache is None:
                cache = kwargs.get("past_key_values")
            if cache is None:
                cache = kwargs["cache"] = self.new_cache()
            prompt = kwargs.get("input_ids", args[0] if args else None)
            if prompt is None:
                prompt = kwargs.get("inputs_embeds")
            if isinstance(cache, AnchorKVCache) and prompt is not None and cache.get_seq_length() == 0:
                for length in sorted(set(lengths or [int(prompt.shape[1])])):
                    cache.check_budget(length)  # before any compute
            return original(*args, **kwargs)

        model.generate = generate

    def disable(self) -> None:
        """Restore the model's attention implementation and generate()."""
        if self._original_generate is None:
            return
        original, had_own = self._original_generate
        if had_own:
            self.model.generate = original
        else:
            del self.model.generate
        self.model.set_attn_implementation(self._previous_attention)
        self._original_generate = None


def enable(model, *, context: Context | None = None, **options: Any) -> AnchorKV:
    """Turn anchorkv on for model.generate(): every call without its own cache gets a fresh
    AnchorKVCache(model, **options). Returns the handle (handle.disable() turns it off)."""
    handle = AnchorKV(model, dict(options), context)
    handle._install()
    return handle


class AnchorKVPress:
    """KVPress-style: ``with AnchorKVPress(compression_ratio=0.9)(model): model.generate(...)``.

    compression_ratio: the fraction of the KV cache's bytes removed, as in KVPress (0.9 keeps
    10%: retain_fraction = 1 - compression_ratio). Other keyword arguments are anchorkv
    compress options (method="anchorkv" by default).
    """

    def __init__(self, compression_ratio: float = 0.9, **options: Any):
        if not 0.0 <= compression_ratio < 1.0:
            raise ValueError(f"compression_ratio must be in [0, 1); got {compression_ratio}")
        self.compression_ratio = compression_ratio
        self.options = options

    @contextmanager
    def __call__(self, model):
        options = dict(self.options)
        if self.compression_ratio > 0:
            options.setdefault("retain_fraction", 1.0 - self.compression_ratio)
        else:
            options.setdefault("method", "fullkv")
        handle = enable(model, **options)
        try:
            yield handle
        finally:
            handle.disable()


__all__ = ["AnchorKVCache", "AnchorKVLayer", "AnchorKV", "AnchorKVPress", "anchorkv_attention",
           "enable", "register", "ATTENTION_NAME"]
