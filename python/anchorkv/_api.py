"""High-level API: Context and Cache own their C handles; arrays go in without copies."""
from __future__ import annotations

import ctypes
import threading
import warnings
from ctypes import byref, c_size_t
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, Union, overload

import numpy as np

from . import _capi
from . import _tensors as tensors
from ._enums import (Backend, DType, Method, PoolType, ResidualScale, RopeStyle, Status)
from ._errors import BudgetError, InvalidArgumentError, MismatchError, check


# An array argument: a numpy array, any object with __dlpack__ or __cuda_array_interface__
# (torch, CuPy, JAX), or a nested sequence of numbers (copied into numpy).
ArrayLike = Union[np.ndarray, Any]


# ---- Plain result records ----------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """Shape of one layer of one request (akv_shape)."""

    seq_len: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int


@dataclass(frozen=True)
class CacheStats:
    """akv_cache_stats: byte accounting and counts of one cache."""

    method: Method
    shape: Shape
    storage_dtype: DType
    window: int
    anchors: int
    appended_tokens: int
    append_capacity: int
    full_bytes: int
    budget_bytes: int
    base_bytes: int
    compressed_bytes: int
    appended_bytes: int
    allocated_bytes: int
    ratio: float
    key_residuals: int
    value_residuals: int
    compactions: int = 0
    storage_format: int = 0  # AnchorKV: 2 or 3; 0 for the other methods
    segment_tokens: int = 0  # AnchorKV storage format 3: positions per segment


@dataclass(frozen=True)
class HeadStats:
    """akv_head_stats: what one KV head keeps."""

    kept_tokens: int
    anchors: int
    key_residuals: int
    value_residuals: int


def _shape_from_c(shape: _capi.akv_shape) -> Shape:
    return Shape(shape.seq_len, shape.num_kv_heads, shape.num_q_heads, shape.head_dim)


# ---- Compression options ---------------------------------------------------------------------

_OPTION_CONVERTERS = {
    "method": Method.parse,
    "retain_fraction": float,
    "window": int,
    "anchors": int,
    "scored_fraction": float,
    "pool_kernel": int,
    "pool_type": PoolType.parse,
    "residual_scale": ResidualScale.parse,
    "seed": int,
    "layer_index": int,
    "layer_count": int,
    "keys_post_rope": lambda value: int(bool(value)),
    "softmax_scale": float,
    "storage_dtype": DType.parse,
    "adakv_alpha": float,
    "quant_bits": int,
    "quant_outliers": int,
    "pyramid_beta": int,
    "andpro_chunk": int,
    "sink_tokens": int,
    "fill_budget": lambda value: int(bool(value)),
    "anchor_share": float,
    "guard_fraction": float,
    "coverage_rounds": int,
    "compact_after": int,
    "storage_format": int,
    "scored_min": int,
    "follow_tokens": int,
    "logit_correction": float,
}
_ROPE_CONVERTERS = {"rope_style": ("style", RopeStyle.parse), "rotary_dim": ("rotary_dim", int),
                    "rope_base": ("base", float)}
OPTION_NAMES = tuple(_OPTION_CONVERTERS) + tuple(_ROPE_CONVERTERS) + ("inv_freq", "preset")


def compress_options(*, head_dim: int | None = None,
                     **options) -> tuple[_capi.akv_compress_options, Any]:
    """An initialised akv_compress_options with the given fields set (None: the default).

    Starts from akv_compress_options_init_method(method) when a method is given (that
    method's paper defaults: SnapKV's window 64, QUANTIZED's 3 bits...), from
    akv_compress_options_init_paper with preset="paper" (AnchorKV as in its paper), else
    from akv_compress_options_init (AnchorKV). Names are the C field names; the RoPE ones are
    rope_style, rotary_dim, rope_base and inv_freq (host float32 array, rotary_dim/2
    values). Returns the struct and what must stay alive while the library reads it.

    The C struct carries no length for inv_freq: the library reads rotary_dim/2 floats (with
    rotary_dim 0 meaning head_dim), so a table of another length is refused here
    (InvalidArgumentError); head_dim is needed for that check when rotary_dim is 0.
    """
    struct = _capi.akv_compress_options()
    preset = options.pop("preset", None)
    if preset not in (None, "paper"):
        raise ValueError(f"unknown preset {preset!r}; known: 'paper'")
    if preset == "paper":
        if options.get("method") not in (None, Method.ANCHORKV, "anchorkv", "ANCHORKV"):
            raise ValueError("preset='paper' is AnchorKV's; pass no other method")
        _capi.akv_compress_options_init_paper(byref(struct))
    elif options.get("method") is not None:
        _capi.akv_compress_options_init_method(
            byref(struct), _convert_option("method", Method.parse, options["method"]))
    else:
        _capi.akv_compress_options_init(byref(struct))
    keepalive = None
    for name, value in options.items():
        if value is None:
            continue
        if name in _OPTION_CONVERTERS:
            setattr(struct, name, _convert_option(name, _OPTION_CONVERTERS[name], value))
        elif name in _ROPE_CONVERTERS:
            field, convert = _ROPE_CONVERTERS[name]
            setattr(struct.rope, field, _convert_option(name, convert, value))
        elif name == "inv_freq":
            keepalive = _convert_option(name, _float32_array, value)
            struct.rope.inv_freq = keepalive.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
        else:
            raise TypeError(f"unknown compression option {name!r}; known: {', '.join(OPTION_NAMES)}")
    if keepalive is not None:
        _check_inv_freq(keepalive, struct.rope, head_dim)
    return struct, keepalive


def _convert_option(name: str, convert, value):
    """convert(value), with a TypeError that names the option when value has the wrong type."""
    try:
        return convert(value)
    except TypeError:
        raise TypeError(f"compression option {name} must be a number or a name, not "
                        f"{type(value).__name__}") from None
    except ValueError as error:
        raise ValueError(f"compression option {name}: {error}") from None


def _float32_array(value) -> np.ndarray:
    return np.ascontiguousarray(value, dtype=np.float32)


def _check_inv_freq(table: np.ndarray, rope: _capi.akv_rope, head_dim: int | None) -> None:
    """The library reads rotary_dim/2 frequencies from the table: it must hold exactly that."""
    if table.ndim != 1:
        raise InvalidArgumentError(f"inv_freq must be one-dimensional; got shape {table.shape}")
    if rope.style == RopeStyle.NONE:
        return  # not read without a rotation
    rotary_dim = rope.rotary_dim or head_dim
    if rotary_dim is None:
        raise InvalidArgumentError("inv_freq with rotary_dim 0 (= head_dim): pass head_dim so that "
                                   "its length can be checked")
    if rotary_dim > 0 and table.size != rotary_dim // 2:
        raise InvalidArgumentError(f"inv_freq holds {table.size} frequencies; rotary_dim {rotary_dim} "
                                   f"needs {rotary_dim // 2}")


def compressed_size(seq_len: int, num_kv_heads: int, head_dim: int, *,
                    num_q_heads: int | None = None, **options) -> int:
    """Exact bytes a compressed cache of this shape will hold (akv_compressed_size)."""
    struct, _keepalive = compress_options(head_dim=head_dim, **options)
    shape = _capi.akv_shape(seq_len, num_kv_heads, num_q_heads or num_kv_heads, head_dim)
    size = c_size_t()
    check(_capi.akv_compressed_size(byref(struct), byref(shape), byref(size)))
    return size.value


def smallest_retain_fraction(seq_len: int, num_kv_heads: int, head_dim: int, *,
                             num_q_heads: int | None = None, **options) -> float:
    """The smallest retain_fraction whose budget holds what these options always keep at this
    shape (the bound AKV_ERR_BUDGET names), found with akv_compressed_size; 1.0 when even
    the full budget is too small (BudgetError then says why)."""
    options.pop("retain_fraction", None)
    def fits(fraction: float) -> bool:
        try:
            compressed_size(seq_len, num_kv_heads, head_dim, num_q_heads=num_q_heads,
                            retain_fraction=fraction, **options)
            return True
        except BudgetError:
            return False
    if not fits(1.0):
        compressed_size(seq_len, num_kv_heads, head_dim, num_q_heads=num_q_heads, retain_fraction=1.0,
                        **options)  # raises with the library's reason
    lo, hi = 0.0, 1.0
    while hi - lo > 1e-7 * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def fit_budget(seq_len: int, num_kv_heads: int, head_dim: int, *, num_q_heads: int | None = None,
               on_budget: str = "raise", what: str = "compress", **options) -> dict:
    """The options, with retain_fraction raised to the smallest workable one when these cannot
    be met at this shape and on_budget is "clamp" (with a warning); "raise": BudgetError now,
    before any data is read."""
    if on_budget not in ("raise", "clamp"):
        raise InvalidArgumentError(f"on_budget must be 'raise' or 'clamp', not {on_budget!r}")
    try:
        compressed_size(seq_len, num_kv_heads, head_dim, num_q_heads=num_q_heads, **options)
        return options
    except BudgetError as error:
        if on_budget == "raise":
            raise
        smallest = smallest_retain_fraction(seq_len, num_kv_heads, head_dim, num_q_heads=num_q_heads, **options)
        requested = options.get("retain_fraction",
                                compress_options(head_dim=head_dim, **options)[0].retain_fraction)
        warnings.warn(f"anchorkv {what}: retain_fraction {requested:g} cannot hold a {seq_len}-token prompt "
                      f"({error}); using {smallest:.6g} (on_budget='raise' refuses instead)", stacklevel=3)
        return dict(options, retain_fraction=smallest)


def model_compressed_size(num_layers: int, seq_len: int, num_kv_heads: int, head_dim: int, *,
                          num_q_heads: int | None = None, retain_fractions=None, **options) -> int:
    """Exact bytes of a whole model's compressed prompt (akv_compressed_size_model): the sum
    over num_layers layers, retain_fractions (one per layer) overriding retain_fraction."""
    struct, _keepalive = compress_options(head_dim=head_dim, **options)
    shape = _capi.akv_shape(seq_len, num_kv_heads, num_q_heads or num_kv_heads, head_dim)
    if retain_fractions is not None and len(retain_fractions) != num_layers:
        raise InvalidArgumentError(f"retain_fractions holds {len(retain_fractions)} values for {num_layers} layers")
    fractions = None if retain_fractions is None else (ctypes.c_double * num_layers)(*retain_fractions)
    total = c_size_t()
    check(_capi.akv_compressed_size_model(byref(struct), byref(shape), num_layers, fractions, None,
                                          byref(total)))
    return total.value


# ---- Context -------------------------------------------------------------------------------


class _ContextHandle:
    """The C context and who still needs it: the Context object and every live Cache.

    akv_context_destroy must come after every cache of the context is destroyed. Python's
    garbage collector may finalize a Context before its caches (reference cycles), so the
    handle is destroyed by whoever lets go last.
    """

    def __init__(self, raw):
        self.raw = raw
        self._owner_released = False
        self._live_caches = 0
        self._lock = threading.Lock()

    def cache_opened(self):
        with self._lock:
            self._live_caches += 1

    def cache_closed(self):
        with self._lock:
            self._live_caches -= 1
            self._destroy_if_unused()

    def release_owner(self):
        with self._lock:
            self._owner_released = True
            self._destroy_if_unused()

    def _destroy_if_unused(self):
        if self._owner_released and self._live_caches == 0 and self.raw is not None:
            raw, self.raw = self.raw, None
            _capi.akv_context_destroy(raw)


class _Owner:
    """Frees its handle in close(), at the end of a with block, and when collected."""

    def close(self) -> None:  # pragma: no cover - every owner overrides it
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


class Context(_Owner):
    """An anchorkv context (akv_context): a backend, a device, threads, an allocator.

    close() (or leaving a `with` block) releases it; the C context is destroyed once its last
    cache is closed too, so caches stay valid after their context is closed.

    allocator: optional object with alloc(nbytes) -> address (0 on failure, aligned to 256)
    and free(address, nbytes); every byte the library allocates then goes through it.
    """

    def __init__(self, backend: Backend | str = Backend.CPU, *, device: int = 0,
                 num_threads: int = 0, allocator: Any = None):
        options = _capi.akv_context_options()
        _capi.akv_context_options_init(byref(options))
        options.backend = Backend.parse(backend)
        options.device = int(device)
        options.num_threads = int(num_threads)
        self._allocator_callbacks = None
        if allocator is not None:
            # The CFUNCTYPE objects must outlive the C context: keep them on this object and
            # on the handle (which outlives it when caches remain).
            alloc = _capi.akv_alloc_fn(lambda _user, nbytes: allocator.alloc(nbytes) or None)
            free = _capi.akv_free_fn(lambda _user, address, nbytes: allocator.free(address, nbytes))
            options.allocator.alloc = alloc
            options.allocator.free = free
            self._allocator_callbacks = (allocator, alloc, free)
        raw = _capi.akv_context_p()
        check(_capi.akv_context_create(byref(options), byref(raw)))
        self._handle = _ContextHandle(raw)
        self._handle.allocator_callbacks = self._allocator_callbacks
        self.backend = Backend(options.backend)
        self.device = options.device
        self._closed = False

    # -- ownership --
    @property
    def closed(self) -> bool:
        return getattr(self, "_closed", True)

    def close(self) -> None:
        """Release the context. Idempotent."""
        if not self.closed:
            self._closed = True
            self._handle.release_owner()


    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<anchorkv.Context {self.backend.name.lower()}:{self.device} {state}>"

    def _raw(self):
        if self._closed:
            raise InvalidArgumentError("the context is closed")
        return self._handle.raw

    @property
    def _device_kind(self) -> str:
        return tensors.CUDA if self.backend == Backend.CUDA else tensors.CPU

    def _check_device(self, tensor: tensors.TensorView | None, name: str) -> None:
        if tensor is None:
            return
        if tensor.device != self._device_kind:
            raise MismatchError(f"{name} is {tensor.device} memory but the context is "
                                f"{self.backend.name.lower()}")
        if tensor.device == tensors.CUDA and tensor.device_index != self.device:
            raise MismatchError(f"{name} is on CUDA device {tensor.device_index}, the context on {self.device}")

    # -- calls --
    def compress(self, keys, values, queries=None, *, positions=None, dtype=None,
                 num_q_heads: int | None = None, stream=None, on_budget: str = "raise",
                 **options) -> "Cache":
        """Compress one layer: keys, values [H][S][D]; queries [Hq][W][D] (post-RoPE).

        Arrays may be strided in the head and token dimensions (last dimension contiguous)
        and are passed without copying. dtype: needed for raw uint16 bf16/f16 data.
        queries must hold the method's window of positions (AnchorKV 32, SnapKV 64, ...: see
        compress_options()) or `window` must say how many they hold; a mismatch is refused.
        num_q_heads: Hq when no queries are given (default H). on_budget: what to do when
        retain_fraction cannot hold what the method always keeps at this shape: "raise"
        (BudgetError, naming the smallest workable fraction) or "clamp" (warn and use that
        fraction). Other options: see compress_options().
        """
        requested = DType.parse(dtype) if dtype is not None else None
        user_stream = None if stream is None else tensors.resolve_stream(stream, ())
        key_view = tensors.view(keys, name="keys", dtype=requested, stream=user_stream)
        value_view = tensors.view(values, name="values", dtype=requested, stream=user_stream)
        query_view = (None if queries is None else
                      tensors.view(queries, name="queries", dtype=requested, stream=user_stream))
        if isinstance(positions, np.ndarray) and positions.dtype != np.int32 and \
                positions.dtype.kind in "iu":  # e.g. np.arange: a small host copy
            if positions.size and (positions.min() < np.iinfo(np.int32).min or
                                   positions.max() > np.iinfo(np.int32).max):
                raise InvalidArgumentError("positions do not fit in int32")
            positions = positions.astype(np.int32)
        position_view = (None if positions is None else
                         tensors.view(positions, name="positions", expect_int32=True,
                                      stream=user_stream))
        for view, name in ((key_view, "keys"), (value_view, "values"), (query_view, "queries"),
                           (position_view, "positions")):
            self._check_device(view, name)

        if len(key_view.shape) != 3 or value_view.shape != key_view.shape:
            raise InvalidArgumentError(f"keys and values must both be [H][S][D]; got "
                                       f"{key_view.shape} and {value_view.shape}")
        if value_view.dtype != key_view.dtype:
            raise InvalidArgumentError("keys and values must have the same dtype")
        heads, seq_len, head_dim = key_view.shape
        if query_view is not None:
            if len(query_view.shape) != 3 or query_view.shape[2] != head_dim:
                raise InvalidArgumentError(f"queries must be [Hq][W][{head_dim}]; got {query_view.shape}")
            if query_view.dtype != key_view.dtype:
                raise InvalidArgumentError("queries must have the dtype of keys and values")
            if num_q_heads is not None and num_q_heads != query_view.shape[0]:
                raise InvalidArgumentError("num_q_heads disagrees with queries.shape[0]")
            num_q_heads = query_view.shape[0]
        if position_view is not None:
            position_view = tensors.contiguous(position_view, name="positions")
            if position_view.shape != (seq_len,):
                raise InvalidArgumentError(f"positions must be [{seq_len}]; got {position_view.shape}")

        key_view, value_view = _shared_token_strides(key_view, value_view)
        if query_view is not None:
            query_view = _strided_ok(query_view, "queries")

        if on_budget != "raise":
            options = fit_budget(seq_len, heads, head_dim, num_q_heads=num_q_heads or heads, on_budget=on_budget,
                                 **options)
        struct, keepalive = compress_options(head_dim=head_dim, **options)
        if query_view is not None:
            _check_window(struct, query_view.shape[1], options.get("window") is not None)
        prefill = _capi.akv_prefill()
        _capi.akv_prefill_init(byref(prefill))
        prefill.shape = _capi.akv_shape(seq_len, heads, num_q_heads or heads, head_dim)
        prefill.dtype = key_view.dtype
        prefill.keys = key_view.pointer
        prefill.values = value_view.pointer
        prefill.kv_head_stride, prefill.kv_token_stride = _stride_fields(key_view)
        if query_view is not None:
            prefill.queries = query_view.pointer
            prefill.q_head_stride, prefill.q_token_stride = _stride_fields(query_view)
        if position_view is not None:
            prefill.positions = ctypes.cast(position_view.pointer, ctypes.POINTER(ctypes.c_int32))
        raw_stream = self._stream(stream, (key_view, value_view, query_view))
        raw_cache = _capi.akv_cache_p()
        check(_capi.akv_compress(self._raw(), byref(prefill), byref(struct), byref(raw_cache),
                                 raw_stream))
        del keepalive, key_view, value_view, query_view, position_view  # read during the call only
        return Cache._adopt(self, raw_cache)

    def deserialize(self, data, *, stream=None) -> "Cache":
        """A cache from akv_cache_serialize bytes (any bytes-like object, host memory)."""
        buffer = np.frombuffer(data, dtype=np.uint8)  # no copy; read-only is fine
        raw_cache = _capi.akv_cache_p()
        check(_capi.akv_cache_deserialize(self._raw(), buffer.ctypes.data, buffer.nbytes,
                                          byref(raw_cache), self._stream(stream, ())))
        return Cache._adopt(self, raw_cache)

    def decode_batch(self, caches: Sequence["Cache"], queries, out=None, *, dtype=None,
                     stream=None, lse=None):
        """Decode many caches of this context at once: queries, out [B][Hq][q_len][D].

        lse: as for Cache.decode, [B][Hq][q_len] float32.
        """
        if not caches:
            raise InvalidArgumentError("decode_batch needs at least one cache")
        shape = caches[0].shape
        requested = DType.parse(dtype) if dtype is not None else None
        user_stream = None if stream is None else tensors.resolve_stream(stream, ())
        query_view = tensors.view(queries, name="queries", dtype=requested, stream=user_stream)
        self._check_device(query_view, "queries")
        if len(query_view.shape) != 4 or query_view.shape[0] != len(caches) or \
                query_view.shape[1] != shape.num_q_heads or query_view.shape[3] != shape.head_dim:
            raise InvalidArgumentError(
                f"queries must be [{len(caches)}][{shape.num_q_heads}][q_len][{shape.head_dim}]; "
                f"got {query_view.shape}")
        query_view = tensors.contiguous(query_view, name="queries")
        out_object, out_view = self._output(out, query_view, "out", user_stream)
        lse_object, lse_pointer = self._lse_output(lse, query_view.shape[:3], query_view, user_stream)
        raw_stream = self._stream(stream, (query_view, out_view))
        raw_caches = (_capi.akv_cache_p * len(caches))()
        for index, cache in enumerate(caches):
            raw_caches[index] = cache._raw()
        # One thread per cache at a time: take every cache's lock, in a fixed order.
        ordered = sorted(set(caches), key=id)
        for cache in ordered:
            cache._lock.acquire()
        try:
            check(_capi.akv_decode_batch_lse(self._raw(), raw_caches, len(caches),
                                             query_view.pointer, query_view.dtype,
                                             query_view.shape[2], out_view.pointer, lse_pointer,
                                             raw_stream))
        finally:
            for cache in reversed(ordered):
                cache._lock.release()
        return out_object if lse is not True else (out_object, lse_object)

    # -- helpers --
    def _lse_output(self, lse, shape, like: tensors.TensorView, user_stream):
        """(object, pointer) of the float32 log-sum-exp output: None, True (allocate) or an array."""
        if lse is None or lse is False:
            return None, None
        if lse is True:
            lse = tensors.empty_like_kind(like, tuple(shape), DType.F32, like.device,
                                          like.device_index)
        lse_view = tensors.view(lse, name="lse", stream=user_stream, writable=True)
        self._check_device(lse_view, "lse")
        if tuple(lse_view.shape) != tuple(shape) or lse_view.dtype != DType.F32 or \
                not lse_view.is_contiguous:
            raise InvalidArgumentError(f"lse must be contiguous {tuple(shape)} of F32; got "
                                       f"{lse_view.shape} of {getattr(lse_view.dtype, 'name', None)}")
        return lse, lse_view.pointer

    def _stream(self, stream, views: Iterable) -> int | None:
        if self.backend != Backend.CUDA:
            return None
        return tensors.resolve_stream(stream, [view for view in views if view is not None]) or None

    def _output(self, out, like: tensors.TensorView, name: str, user_stream):
        """(object returned to the caller, its view) for an output shaped like `like`."""
        if out is None:
            out = tensors.empty_like_kind(like, like.shape, like.dtype, like.device, like.device_index)
        out_view = tensors.view(out, name=name, dtype=like.dtype if like.dtype == DType.BF16 else None,
                                stream=user_stream, writable=True)
        self._check_device(out_view, name)
        if out_view.shape != like.shape or out_view.dtype != like.dtype:
            raise InvalidArgumentError(f"{name} must be {like.shape} of {like.dtype.name}; got "
                                       f"{out_view.shape} of {getattr(out_view.dtype, 'name', None)}")
        if not out_view.is_contiguous:
            raise InvalidArgumentError(f"{name} must be contiguous")
        return out, out_view


def _check_window(struct: _capi.akv_compress_options, positions: int, given: bool) -> None:
    """The queries must cover the method's window: refuse a mismatch rather than pick a winner.

    Taking the window from the queries would silently change a method's setup (SnapKV,
    PyramidKV and AdaKV observe 64 positions in their papers; an engine following AnchorKV's
    32 would get another SnapKV). FullKV reads no window, so any count of queries is fine.
    """
    if positions == struct.window:
        return
    if given:
        raise InvalidArgumentError(f"window={struct.window} but queries hold {positions} positions")
    if struct.method == Method.FULLKV:
        struct.window = positions
        return
    method = Method(struct.method).name
    raise InvalidArgumentError(
        f"queries hold {positions} positions but {method}'s window is {struct.window}: pass "
        f"window={positions} to observe {positions} positions, or the queries of the last "
        f"{struct.window}")


def _stride_fields(view: tensors.TensorView) -> tuple[int, int]:
    return view.strides[0], view.strides[1]


def _strided_ok(view: tensors.TensorView, name: str) -> tensors.TensorView:
    """Keep a [A][B][D] view as is when the C strides can describe it, else copy (numpy)."""
    heads, tokens, dim = view.shape
    head_stride, token_stride, element_stride = view.strides
    # Stride 0 means "default" to the C API: only positive strides can be passed through.
    if (dim == 1 or element_stride == 1) and (head_stride > 0 or heads == 1) and \
            (token_stride > 0 or tokens == 1):
        compact_token = token_stride if tokens > 1 else dim
        compact_head = head_stride if heads > 1 else tokens * compact_token
        return tensors.TensorView(view.pointer, view.shape, (compact_head, compact_token, 1),
                                  view.dtype, view.device, view.device_index, view.owner, view.kind)
    return tensors.contiguous(view, name=name)


def _shared_token_strides(keys: tensors.TensorView, values: tensors.TensorView):
    """keys and values share one pair of strides in akv_prefill: copy when they differ."""
    keys, values = _strided_ok(keys, "keys"), _strided_ok(values, "values")
    if keys.strides != values.strides:
        keys, values = tensors.contiguous(keys, name="keys"), tensors.contiguous(values, name="values")
        if keys.strides != values.strides:  # both contiguous now unless a copy was refused
            raise InvalidArgumentError("keys and values must have the same strides")
    return keys, values


# ---- Cache ----------------------------------------------------------------------------------


class Cache(_Owner):
    """One compressed layer of one request (akv_cache). Keeps its Context alive.

    Create with Context.compress, anchorkv.compress, Context.deserialize or
    Cache.from_bytes. close() frees it (also on `with` exit and garbage collection).
    Calls on one Cache are serialised by a lock, as the C API requires.
    """

    def __init__(self):
        raise TypeError("create caches with Context.compress, anchorkv.compress or Cache.from_bytes")

    @classmethod
    def _adopt(cls, context: Context, raw_cache) -> "Cache":
        cache = object.__new__(cls)
        cache._context = context
        cache._context_handle = context._handle
        cache._context_handle.cache_opened()
        cache._raw_handle = raw_cache
        cache._lock = threading.Lock()
        cache._host = context.backend == Backend.CPU  # numpy arrays take the fast paths
        try:
            cache._shape = cache.stats.shape
        except BaseException:
            cache.close()
            raise
        return cache

    # -- ownership --
    @property
    def context(self) -> Context:
        return self._context

    @property
    def closed(self) -> bool:
        return getattr(self, "_raw_handle", None) is None

    def close(self) -> None:
        """Destroy the C cache. Idempotent."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            raw, self._raw_handle = getattr(self, "_raw_handle", None), None
        if raw is not None:
            _capi.akv_cache_destroy(raw)
            self._context_handle.cache_closed()


    def __repr__(self) -> str:
        if self.closed:
            return "<anchorkv.Cache closed>"
        return (f"<anchorkv.Cache S={self._shape.seq_len} H={self._shape.num_kv_heads} "
                f"Hq={self._shape.num_q_heads} D={self._shape.head_dim}>")

    def _raw(self):
        raw = self._raw_handle
        if raw is None:
            raise InvalidArgumentError("the cache is closed")
        return raw

    # -- inspection --
    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def stats(self) -> CacheStats:
        struct = _capi.akv_cache_stats()
        struct.struct_size = ctypes.sizeof(struct)
        with self._lock:
            check(_capi.akv_cache_stats_get(self._raw(), byref(struct)))
        return CacheStats(
            Method(struct.method), _shape_from_c(struct.shape), DType(struct.storage_dtype),
            struct.window, struct.anchors, struct.appended_tokens, struct.append_capacity,
            struct.full_bytes, struct.budget_bytes, struct.base_bytes, struct.compressed_bytes,
            struct.appended_bytes, struct.allocated_bytes, struct.ratio, struct.key_residuals,
            struct.value_residuals, struct.compactions, struct.storage_format, struct.segment_tokens)

    def head_stats(self) -> list[HeadStats]:
        heads = (_capi.akv_head_stats * self._shape.num_kv_heads)()
        with self._lock:
            check(_capi.akv_cache_head_stats(self._raw(), heads))
        return [HeadStats(h.kept_tokens, h.anchors, h.key_residuals, h.value_residuals)
                for h in heads]

    @property
    def num_tokens(self) -> int:
        """T: compressed positions (the prompt, and what compaction folded in) plus appended tokens."""
        stats = self.stats
        return stats.shape.seq_len + stats.appended_tokens

    # -- appending and decoding --
    def reserve(self, tokens: int, *, stream=None) -> None:
        """Room for `tokens` appended tokens in total, so append/decode never allocate."""
        with self._lock:
            check(_capi.akv_cache_reserve(self._raw(), int(tokens), self._context._stream(stream, ())))

    def append(self, keys: ArrayLike, values: ArrayLike, positions: ArrayLike | None = None, *,
               dtype: DType | str | None = None, stream: Any = None) -> None:
        """Append new tokens exactly: keys, values [H][n][D] (or [H][D] for one token)."""
        if self._host and dtype is None and positions is None:  # the per-token call (numpy)
            code = _plain_host(keys)
            shape = keys.shape if code is not None else ()
            if len(shape) in (2, 3) and shape[0] == self._shape.num_kv_heads and \
                    shape[-1] == self._shape.head_dim and shape[-2] > 0 and \
                    _plain_host(values) == code and values.shape == shape:
                with self._lock:
                    status = _capi.akv_append(self._raw(), _address(keys), _address(values), code,
                                              shape[1] if len(shape) == 3 else 1, None, None)
                if status:
                    check(status)
                return
        requested = DType.parse(dtype) if dtype is not None else None
        user_stream = None if stream is None else tensors.resolve_stream(stream, ())
        key_view = tensors.view(keys, name="keys", dtype=requested, stream=user_stream)
        value_view = tensors.view(values, name="values", dtype=requested, stream=user_stream)
        for view, name in ((key_view, "keys"), (value_view, "values")):
            self._context._check_device(view, name)
        heads, head_dim = self._shape.num_kv_heads, self._shape.head_dim
        if len(key_view.shape) == 2:
            key_view, value_view = _with_token_axis(key_view), _with_token_axis(value_view)
        if len(key_view.shape) != 3 or key_view.shape[0] != heads or key_view.shape[2] != head_dim \
                or value_view.shape != key_view.shape:
            raise InvalidArgumentError(f"keys and values must be [{heads}][n][{head_dim}]; got "
                                       f"{key_view.shape} and {value_view.shape}")
        if value_view.dtype != key_view.dtype:
            raise InvalidArgumentError("keys and values must have the same dtype")
        key_view = tensors.contiguous(key_view, name="keys")
        value_view = tensors.contiguous(value_view, name="values")
        num_tokens = key_view.shape[1]
        position_pointer, position_array = None, None
        if positions is not None:  # host memory for every backend
            position_array = np.ascontiguousarray(positions, dtype=np.int32)
            if position_array.shape != (num_tokens,):
                raise InvalidArgumentError(f"positions must be [{num_tokens}]; got {position_array.shape}")
            position_pointer = position_array.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        raw_stream = self._context._stream(stream, (key_view, value_view))
        with self._lock:
            check(_capi.akv_append(self._raw(), key_view.pointer, value_view.pointer,
                                   key_view.dtype, num_tokens, position_pointer, raw_stream))
        del position_array

    @overload
    def decode(self, queries: np.ndarray, out: np.ndarray | None = None, *,
               dtype: DType | str | None = None, stream: None = None,
               lse: None = None) -> np.ndarray: ...

    @overload
    def decode(self, queries: ArrayLike, out: ArrayLike | None = None, *,
               dtype: DType | str | None = None, stream: Any = None,
               lse: Any = None) -> Any: ...

    def decode(self, queries, out=None, *, dtype=None, stream=None, lse=None):
        """Attention of new queries over the whole cache.

        queries: [Hq][q_len][D] (or [Hq][D] for q_len = 1), post-RoPE; out: same shape and
        dtype, allocated (numpy, torch or CuPy, like the queries) when not given. Returns out.
        lse: None, True, or a float32 array [Hq][q_len] (or [Hq]) on the queries' device that
        receives each row's log-sum-exp (natural log of the softmax denominator, logits scaled
        by the cache's softmax_scale), to merge with attention over other tokens
        (akv_decode_lse). True allocates it and returns (out, lse).
        """
        # The per-token call: numpy without the general path.
        if self._host and dtype is None and lse is None:
            code = _plain_host(queries)
            shape = queries.shape if code is not None else ()
            if len(shape) in (2, 3) and shape[0] == self._shape.num_q_heads and \
                    shape[-1] == self._shape.head_dim and shape[-2] > 0:
                if out is None:
                    out = np.empty(shape, queries.dtype)
                if _plain_host(out) == code and out.shape == shape and out.flags.writeable:
                    with self._lock:
                        status = _capi.akv_decode(self._raw(), _address(queries), code,
                                                  shape[1] if len(shape) == 3 else 1,
                                                  _address(out), None)
                    if status:
                        check(status)
                    return out
        return self._decode_any(queries, out, dtype, stream, lse)

    def _decode_any(self, queries, out, dtype, stream, lse):
        """decode() for every kind of array: views, device checks, strides, streams."""
        requested = DType.parse(dtype) if dtype is not None else None
        user_stream = None if stream is None else tensors.resolve_stream(stream, ())
        query_view = tensors.view(queries, name="queries", dtype=requested, stream=user_stream)
        self._context._check_device(query_view, "queries")
        squeezed = len(query_view.shape) == 2
        if squeezed:
            query_view = _with_token_axis(query_view)
        q_heads, head_dim = self._shape.num_q_heads, self._shape.head_dim
        if len(query_view.shape) != 3 or query_view.shape[0] != q_heads or \
                query_view.shape[2] != head_dim or query_view.shape[1] < 1:
            raise InvalidArgumentError(f"queries must be [{q_heads}][q_len][{head_dim}] or "
                                       f"[{q_heads}][{head_dim}]; got {query_view.shape}")
        query_view = tensors.contiguous(query_view, name="queries")
        if out is None:
            out = tensors.empty_like_kind(query_view, (q_heads, head_dim) if squeezed
                                          else query_view.shape, query_view.dtype,
                                          query_view.device, query_view.device_index)
        out_object = out
        out_view = tensors.view(out, name="out", dtype=query_view.dtype
                                if query_view.dtype == DType.BF16 else None,
                                stream=user_stream, writable=True)
        self._context._check_device(out_view, "out")
        if len(out_view.shape) == 2:
            out_view = _with_token_axis(out_view)
        if out_view.shape != query_view.shape or out_view.dtype != query_view.dtype or \
                not out_view.is_contiguous:
            raise InvalidArgumentError(f"out must be contiguous {query_view.shape} of "
                                       f"{query_view.dtype.name}")
        lse_object, lse_pointer = self._context._lse_output(
            lse, (q_heads,) if squeezed else query_view.shape[:2], query_view, user_stream)
        raw_stream = self._context._stream(stream, (query_view, out_view))
        with self._lock:
            check(_capi.akv_decode_lse(self._raw(), query_view.pointer, query_view.dtype,
                                       query_view.shape[1], out_view.pointer, lse_pointer,
                                       raw_stream))
        return out_object if lse is not True else (out_object, lse_object)

    def compact(self, queries, headroom_tokens: int = 0, *, dtype=None, stream=None) -> None:
        """akv_cache_compact: fold the appended tokens into the compressed form.

        queries: [Hq][W][D] post-RoPE queries of the last W cached tokens (W = stats.window).
        headroom_tokens: dense tokens to leave budget for until the next compaction.
        """
        requested = DType.parse(dtype) if dtype is not None else None
        user_stream = None if stream is None else tensors.resolve_stream(stream, ())
        query_view = tensors.view(queries, name="queries", dtype=requested, stream=user_stream)
        self._context._check_device(query_view, "queries")
        window = self.stats.window
        expected = (self._shape.num_q_heads, window, self._shape.head_dim)
        if window and tuple(query_view.shape) != expected:  # window 0 (FullKV): the library refuses
            raise InvalidArgumentError(f"queries must be {list(expected)}; got {query_view.shape}")
        query_view = tensors.contiguous(query_view, name="queries")
        raw_stream = self._context._stream(stream, (query_view,))
        with self._lock:
            check(_capi.akv_cache_compact(self._raw(), query_view.pointer, query_view.dtype,
                                          int(headroom_tokens), raw_stream))

    def reconstruct(self, dtype: DType | str = DType.F32, *, rotated: bool = True,
                    keys=None, values=None, present=None, stream=None):
        """Dense (keys, values, present) of every cached token: [H][T][D], [H][T] uint8.

        keys are post-RoPE when rotated. On CUDA pass the outputs (or have torch installed).
        """
        dtype = DType.parse(dtype)
        stats = self.stats
        shape = (self._shape.num_kv_heads, stats.shape.seq_len + stats.appended_tokens,
                 self._shape.head_dim)
        on_cuda = self._context.backend == Backend.CUDA
        views = []
        results = []
        for given, name, element in ((keys, "keys", dtype), (values, "values", dtype),
                                     (present, "present", None)):
            target_shape = shape if element is not None else shape[:2]
            if given is None:
                given = _allocate(target_shape, element, on_cuda, self._context.device)
            results.append(given)
            if element is None:
                view = _byte_view(given, name)
            else:
                view = tensors.view(given, name=name, dtype=element if element == DType.BF16 else None,
                                    writable=True)
            self._context._check_device(view, name)
            if view.shape != target_shape or (element is not None and view.dtype != element) \
                    or not view.is_contiguous:
                raise InvalidArgumentError(f"{name} must be contiguous {target_shape}")
            views.append(view)
        raw_stream = self._context._stream(stream, views)
        present_pointer = ctypes.cast(views[2].pointer, ctypes.POINTER(ctypes.c_uint8))
        with self._lock:
            check(_capi.akv_cache_reconstruct(self._raw(), dtype, int(bool(rotated)),
                                              views[0].pointer, views[1].pointer,
                                              present_pointer, raw_stream))
        return tuple(results)

    def logit_penalty(self, *, stream=None) -> np.ndarray:
        """[H][T] float32 (host): what decode subtracts from each token's logit per |s q|^2.

        With reconstruct()'s post-RoPE keys, decode is softmax(s q.k_t - penalty[h, t] |s q|^2)
        over the values (s the softmax scale). Non-zero only for the reconstructed prompt
        tokens of an AnchorKV cache in storage format 3 compressed with logit_correction > 0.
        """
        stats = self.stats
        out = np.empty((self._shape.num_kv_heads, stats.shape.seq_len + stats.appended_tokens), np.float32)
        raw_stream = self._context._stream(stream, [])
        with self._lock:
            check(_capi.akv_cache_logit_penalty(self._raw(), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                raw_stream))
        return out

    # -- serialization --
    def serialized_size(self) -> int:
        size = c_size_t()
        with self._lock:
            check(_capi.akv_cache_serialized_size(self._raw(), byref(size)))
        return size.value

    def serialize_into(self, buffer, *, stream=None) -> int:
        """Write into a writable bytes-like buffer; returns the bytes written."""
        target = np.frombuffer(buffer, dtype=np.uint8)
        if not target.flags.writeable:
            raise InvalidArgumentError("buffer is read-only")
        written = c_size_t()
        with self._lock:
            check(_capi.akv_cache_serialize(self._raw(), target.ctypes.data, target.nbytes,
                                            byref(written), self._context._stream(stream, ())))
        return written.value

    def to_bytes(self) -> bytes:
        buffer = bytearray(self.serialized_size())
        written = self.serialize_into(buffer)
        return bytes(memoryview(buffer)[:written])

    __bytes__ = to_bytes

    @classmethod
    def from_bytes(cls, data, context: Context | None = None) -> "Cache":
        """Deserialize; without a context, into the shared default CPU context."""
        return (context if context is not None else _default_context()).deserialize(data)


_HOST_DTYPES = {np.dtype(np.float32): int(DType.F32), np.dtype(np.float16): int(DType.F16)}


def _plain_host(array) -> int | None:
    """The akv_dtype of a C-contiguous float32/float16 numpy array; None for anything else
    (which the general path takes)."""
    if type(array) is not np.ndarray or not array.flags.c_contiguous:
        return None
    return _HOST_DTYPES.get(array.dtype)


def _address(array: np.ndarray) -> int:
    """The data address of a C-contiguous numpy array. Through the buffer protocol when it is
    writable: a third of the time of array.ctypes.data, which builds a helper object."""
    if array.flags.writeable:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    return array.ctypes.data


def _with_token_axis(view: tensors.TensorView) -> tensors.TensorView:
    """[A][D] -> [A][1][D] (a view: strides only)."""
    return tensors.TensorView(view.pointer, (view.shape[0], 1, view.shape[1]),
                              (view.strides[0], view.shape[1] * view.strides[1], view.strides[1]),
                              view.dtype, view.device, view.device_index, view.owner, view.kind)


def _allocate(shape, dtype: DType | None, on_cuda: bool, device_index: int):
    """numpy on the CPU; torch (then CuPy) on CUDA. dtype None: uint8."""
    if not on_cuda:
        return np.empty(shape, dtype=np.uint8 if dtype is None else
                        {DType.F32: np.float32, DType.F16: np.float16, DType.BF16: np.uint16}[dtype])
    try:
        import torch
        torch_dtype = torch.uint8 if dtype is None else {
            DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16}[dtype]
        return torch.empty(shape, dtype=torch_dtype, device=torch.device("cuda", device_index))
    except ImportError:
        pass
    if dtype == DType.BF16:
        raise InvalidArgumentError("allocating bf16 device memory needs torch: pass the outputs")
    import cupy
    with cupy.cuda.Device(device_index):
        return cupy.empty(shape, dtype=np.uint8 if dtype is None else
                          {DType.F32: np.float32, DType.F16: np.float16}[dtype])


def _byte_view(obj, name: str) -> tensors.TensorView:
    """A uint8 array (numpy, torch, CuPy) as a view; the dtype checks of view() are for floats."""
    if isinstance(obj, np.ndarray):
        if obj.dtype != np.uint8 or not obj.flags.writeable:
            raise InvalidArgumentError(f"{name} must be a writable uint8 array")
        return tensors.TensorView(obj.ctypes.data, obj.shape, obj.strides, None, tensors.CPU, 0,
                                  obj, "numpy")
    interface = getattr(obj, "__cuda_array_interface__", None)
    if interface is None or interface["typestr"][1:] not in ("u1", "b1"):
        raise InvalidArgumentError(f"{name} must be a uint8 array")
    shape = tuple(interface["shape"])
    strides = tuple(interface["strides"]) if interface.get("strides") else (shape[1], 1)
    index = getattr(getattr(obj, "device", None), "index", None) or 0
    return tensors.TensorView(interface["data"][0], shape, strides, None, tensors.CUDA, index,
                              obj, tensors._kind_of(obj))


def compress(keys, values, queries=None, *, context: Context | None = None, **options) -> Cache:
    """Compress one layer. Without a context, in the shared default CPU context.

    See Context.compress for the arguments.
    """
    return (context if context is not None else _default_context()).compress(keys, values, queries,
                                                                            **options)


_default_lock = threading.Lock()
_default: Context | None = None


def _default_context() -> Context:
    """The CPU context of calls given none: made on first use, then shared by every such call,
    so they share one thread pool (a context per call would start threads per call). Its calls
    are serialised by that pool; pass a Context of your own to compress in parallel."""
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            _default = Context()
        return _default


def status_string(status: Status | int) -> str:
    """The library's static name of a status."""
    return _capi.akv_status_string(int(status)).decode()
