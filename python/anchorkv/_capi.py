"""Low-level ctypes declarations of include/anchorkv/anchorkv.h.

One Python declaration per C declaration, the C prototype as a comment beside it. Nothing
here frees anything or raises on a status: the high-level module (anchorkv._api) does that.

The shared library is found, in order, through
  1. the ANCHORKV_LIBRARY environment variable (a file, or a directory holding the library);
     when it is set and does not load, import fails instead of falling back silently;
  2. the package directory (`pip install ./python` bundles libanchorkv.so.0 beside this file);
  3. the system: the dynamic loader's search path (LD_LIBRARY_PATH, ldconfig), then
     ctypes.util.find_library("anchorkv").
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_double, c_float, c_int,
                    c_int32, c_int64, c_size_t, c_uint, c_uint8, c_uint64, c_void_p)
from pathlib import Path

# The header version this binding was written against (AKV_VERSION_*). The loaded library
# must have the same major and be at least this version.
BINDING_VERSION_MAJOR = 0
BINDING_VERSION_MINOR = 2
BINDING_VERSION_PATCH = 0
BINDING_VERSION_NUMBER = BINDING_VERSION_MAJOR * 10000 + BINDING_VERSION_MINOR * 100 + BINDING_VERSION_PATCH


def version_problem(loaded: int) -> str | None:
    """Why a library of version number `loaded` cannot serve this binding (None: it can).

    Same major as the header the binding was written for, and at least that version.
    """
    if loaded // 10000 != BINDING_VERSION_MAJOR:
        return f"major version {loaded // 10000}, this binding needs {BINDING_VERSION_MAJOR}"
    if loaded < BINDING_VERSION_NUMBER:
        return (f"version number {loaded} is older than the {BINDING_VERSION_NUMBER} this "
                "binding was written for")
    return None


# ---- Library lookup ----------------------------------------------------------------------

if sys.platform == "darwin":
    _LIBRARY_NAMES = (f"libanchorkv.{BINDING_VERSION_MAJOR}.dylib", "libanchorkv.dylib")
elif sys.platform == "win32":
    _LIBRARY_NAMES = ("anchorkv.dll",)
else:
    _LIBRARY_NAMES = (f"libanchorkv.so.{BINDING_VERSION_MAJOR}", "libanchorkv.so")


def _load_library() -> tuple[ctypes.CDLL, str]:
    override = os.environ.get("ANCHORKV_LIBRARY")
    if override:
        path = Path(override)
        candidates = [path / name for name in _LIBRARY_NAMES] if path.is_dir() else [path]
        errors = []
        for candidate in candidates:
            try:
                return ctypes.CDLL(str(candidate)), str(candidate)
            except OSError as error:
                errors.append(f"{candidate}: {error}")
        raise ImportError("ANCHORKV_LIBRARY is set but does not load: " + "; ".join(errors))

    package_dir = Path(__file__).resolve().parent
    for name in _LIBRARY_NAMES:
        candidate = package_dir / name
        if candidate.exists():
            return ctypes.CDLL(str(candidate)), str(candidate)

    errors = []
    for name in _LIBRARY_NAMES:
        try:
            return ctypes.CDLL(name), name
        except OSError as error:
            errors.append(str(error))
    found = ctypes.util.find_library("anchorkv")
    if found:
        return ctypes.CDLL(found), found
    raise ImportError(
        "libanchorkv was not found. Set ANCHORKV_LIBRARY to the library file (or its "
        "directory), put it on LD_LIBRARY_PATH, or install it system-wide. Tried: "
        + "; ".join(errors))


lib, library_path = _load_library()

# ---- Enumerations (C enums are int on every ABI this binding targets) --------------------

akv_status = c_int
akv_dtype = c_int
akv_backend = c_int
akv_method = c_int
akv_rope_style = c_int
akv_pool_type = c_int
akv_residual_scale = c_int

# ---- Opaque handles ------------------------------------------------------------------------


class akv_context(Structure):
    """typedef struct akv_context akv_context; (opaque)"""


class akv_cache(Structure):
    """typedef struct akv_cache akv_cache; (opaque)"""


akv_context_p = POINTER(akv_context)
akv_cache_p = POINTER(akv_cache)

# ---- Structures (field order and types exactly as in the header) --------------------------

# void *(*alloc)(void *user_data, size_t bytes);
akv_alloc_fn = CFUNCTYPE(c_void_p, c_void_p, c_size_t)
# void (*free)(void *user_data, void *ptr, size_t bytes);
akv_free_fn = CFUNCTYPE(None, c_void_p, c_void_p, c_size_t)


class akv_allocator(Structure):
    _fields_ = [
        ("alloc", akv_alloc_fn),
        ("free", akv_free_fn),
        ("user_data", c_void_p),
    ]


class akv_context_options(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("backend", akv_backend),
        ("device", c_int32),
        ("num_threads", c_int32),
        ("allocator", akv_allocator),
    ]


class akv_rope(Structure):
    _fields_ = [
        ("style", akv_rope_style),
        ("rotary_dim", c_int32),
        ("base", c_double),
        ("inv_freq", POINTER(c_float)),
    ]


class akv_compress_options(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("method", akv_method),
        ("retain_fraction", c_double),
        ("window", c_int32),
        ("anchors", c_int32),
        ("scored_fraction", c_double),
        ("pool_kernel", c_int32),
        ("pool_type", akv_pool_type),
        ("residual_scale", akv_residual_scale),
        ("seed", c_uint64),
        ("layer_index", c_int32),
        ("layer_count", c_int32),
        ("rope", akv_rope),
        ("keys_post_rope", c_int32),
        ("softmax_scale", c_float),
        ("storage_dtype", akv_dtype),
        # Baseline methods (appended after the AnchorKV fields)
        ("adakv_alpha", c_double),
        ("quant_bits", c_int32),
        ("quant_outliers", c_int32),
        ("pyramid_beta", c_int32),
        ("andpro_chunk", c_int32),
        # AnchorKV beyond the paper (0.2)
        ("sink_tokens", c_int32),
        ("fill_budget", c_int32),
        ("anchor_share", c_double),
        ("guard_fraction", c_double),
        ("coverage_rounds", c_int32),
        # Tensor parallelism (appended in 0.2).
        ("pool_heads", c_int32),
        ("head_offset", c_int32),
        # Long generations (0.2)
        ("compact_after", c_int64),
        # Storage format (0.3)
        ("storage_format", c_int32),
        # Scoring (0.3)
        ("scored_min", c_int32),
        ("follow_tokens", c_int32),
        # Decode (0.3)
        ("logit_correction", c_double),
    ]


class akv_shape(Structure):
    _fields_ = [
        ("seq_len", c_int64),
        ("num_kv_heads", c_int32),
        ("num_q_heads", c_int32),
        ("head_dim", c_int32),
    ]


class akv_prefill(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("shape", akv_shape),
        ("dtype", akv_dtype),
        ("keys", c_void_p),
        ("values", c_void_p),
        ("queries", c_void_p),
        ("positions", POINTER(c_int32)),
        ("kv_head_stride", c_int64),
        ("kv_token_stride", c_int64),
        ("q_head_stride", c_int64),
        ("q_token_stride", c_int64),
        # Paged keys and values (appended in 0.2).
        ("block_table", POINTER(c_int32)),
        ("block_size", c_int32),
        ("num_blocks", c_int32),
        ("kv_block_stride", c_int64),
    ]


class akv_cache_stats(Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("method", akv_method),
        ("shape", akv_shape),
        ("storage_dtype", akv_dtype),
        ("window", c_int32),
        ("anchors", c_int32),
        ("appended_tokens", c_int64),
        ("append_capacity", c_int64),
        ("full_bytes", c_uint64),
        ("budget_bytes", c_uint64),
        ("base_bytes", c_uint64),
        ("compressed_bytes", c_uint64),
        ("appended_bytes", c_uint64),
        ("allocated_bytes", c_uint64),
        ("ratio", c_double),
        ("key_residuals", c_int64),
        ("value_residuals", c_int64),
        ("compactions", c_int64),
        ("storage_format", c_int32),
        ("segment_tokens", c_int32),
    ]


class akv_head_stats(Structure):
    _fields_ = [
        ("kept_tokens", c_int64),
        ("anchors", c_int64),
        ("key_residuals", c_int64),
        ("value_residuals", c_int64),
    ]


# ---- Functions ------------------------------------------------------------------------------


def _declare(name, restype, argtypes):
    function = getattr(lib, name)
    function.restype = restype
    function.argtypes = argtypes
    return function


# unsigned akv_version_number(void);
akv_version_number = _declare("akv_version_number", c_uint, [])
# const char *akv_version_string(void);
akv_version_string = _declare("akv_version_string", c_char_p, [])

# Checked before anything else is declared: an older library lacks later symbols, and says so
# better through its version than through a missing one.
_version_problem = version_problem(akv_version_number())
if _version_problem:
    raise ImportError(f"{library_path} is anchorkv {akv_version_string().decode()}: {_version_problem}")

# const char *akv_status_string(akv_status status);
akv_status_string = _declare("akv_status_string", c_char_p, [akv_status])
# const char *akv_last_error_message(void);
akv_last_error_message = _declare("akv_last_error_message", c_char_p, [])

# void akv_context_options_init(akv_context_options *options);
akv_context_options_init = _declare("akv_context_options_init", None,
                                    [POINTER(akv_context_options)])
# akv_status akv_context_create(const akv_context_options *options, akv_context **out_context);
akv_context_create = _declare("akv_context_create", akv_status,
                              [POINTER(akv_context_options), POINTER(akv_context_p)])
# void akv_context_destroy(akv_context *context);
akv_context_destroy = _declare("akv_context_destroy", None, [akv_context_p])

# void akv_compress_options_init(akv_compress_options *options);
akv_compress_options_init = _declare("akv_compress_options_init", None,
                                     [POINTER(akv_compress_options)])
# void akv_compress_options_init_method(akv_compress_options *options, akv_method method);
akv_compress_options_init_method = _declare("akv_compress_options_init_method", None,
                                            [POINTER(akv_compress_options), akv_method])
# void akv_compress_options_init_paper(akv_compress_options *options);
akv_compress_options_init_paper = _declare("akv_compress_options_init_paper", None,
                                           [POINTER(akv_compress_options)])
# void akv_prefill_init(akv_prefill *prefill);
akv_prefill_init = _declare("akv_prefill_init", None, [POINTER(akv_prefill)])
# akv_status akv_compressed_size(const akv_compress_options *options, const akv_shape *shape,
#                                size_t *out_bytes);
akv_compressed_size = _declare("akv_compressed_size", akv_status,
                               [POINTER(akv_compress_options), POINTER(akv_shape),
                                POINTER(c_size_t)])
# akv_status akv_compressed_size_model(const akv_compress_options *options, const akv_shape *shape,
#                                      int32_t num_layers, const double *retain_fractions,
#                                      size_t *out_layer_bytes, size_t *out_total_bytes);
akv_compressed_size_model = _declare("akv_compressed_size_model", akv_status,
                                     [POINTER(akv_compress_options), POINTER(akv_shape), c_int32,
                                      POINTER(c_double), POINTER(c_size_t), POINTER(c_size_t)])
# akv_status akv_compress(akv_context *context, const akv_prefill *prefill,
#                         const akv_compress_options *options, akv_cache **out_cache,
#                         void *stream);
akv_compress = _declare("akv_compress", akv_status,
                        [akv_context_p, POINTER(akv_prefill), POINTER(akv_compress_options),
                         POINTER(akv_cache_p), c_void_p])
# void akv_cache_destroy(akv_cache *cache);
akv_cache_destroy = _declare("akv_cache_destroy", None, [akv_cache_p])

# akv_status akv_cache_reserve(akv_cache *cache, int64_t tokens, void *stream);
akv_cache_reserve = _declare("akv_cache_reserve", akv_status, [akv_cache_p, c_int64, c_void_p])
# akv_status akv_append(akv_cache *cache, const void *keys, const void *values, akv_dtype dtype,
#                       int32_t num_tokens, const int32_t *positions, void *stream);
akv_append = _declare("akv_append", akv_status,
                      [akv_cache_p, c_void_p, c_void_p, akv_dtype, c_int32, POINTER(c_int32),
                       c_void_p])
# akv_status akv_decode(akv_cache *cache, const void *queries, akv_dtype dtype, int32_t q_len,
#                       void *out, void *stream);
akv_decode = _declare("akv_decode", akv_status,
                      [akv_cache_p, c_void_p, akv_dtype, c_int32, c_void_p, c_void_p])
# akv_status akv_decode_batch(akv_context *context, akv_cache *const *caches, int32_t batch,
#                             const void *queries, akv_dtype dtype, int32_t q_len, void *out,
#                             void *stream);
akv_decode_batch = _declare("akv_decode_batch", akv_status,
                            [akv_context_p, POINTER(akv_cache_p), c_int32, c_void_p, akv_dtype,
                             c_int32, c_void_p, c_void_p])

# akv_status akv_cache_stats_get(const akv_cache *cache, akv_cache_stats *out_stats);
akv_cache_stats_get = _declare("akv_cache_stats_get", akv_status,
                               [akv_cache_p, POINTER(akv_cache_stats)])
# akv_status akv_cache_head_stats(const akv_cache *cache, akv_head_stats *out_heads);
akv_cache_head_stats = _declare("akv_cache_head_stats", akv_status,
                                [akv_cache_p, POINTER(akv_head_stats)])
# akv_status akv_cache_reconstruct(const akv_cache *cache, akv_dtype dtype, int32_t rotated,
#                                  void *keys, void *values, uint8_t *present, void *stream);
akv_cache_reconstruct = _declare("akv_cache_reconstruct", akv_status,
                                 [akv_cache_p, akv_dtype, c_int32, c_void_p, c_void_p,
                                  POINTER(c_uint8), c_void_p])
# akv_status akv_cache_logit_penalty(const akv_cache *cache, float *out, void *stream);
akv_cache_logit_penalty = _declare("akv_cache_logit_penalty", akv_status,
                                   [akv_cache_p, POINTER(c_float), c_void_p])

# akv_status akv_cache_serialized_size(const akv_cache *cache, size_t *out_bytes);
akv_cache_serialized_size = _declare("akv_cache_serialized_size", akv_status,
                                     [akv_cache_p, POINTER(c_size_t)])
# akv_status akv_cache_serialize(const akv_cache *cache, void *buffer, size_t capacity,
#                                size_t *out_written, void *stream);
akv_cache_serialize = _declare("akv_cache_serialize", akv_status,
                               [akv_cache_p, c_void_p, c_size_t, POINTER(c_size_t), c_void_p])
# akv_status akv_cache_deserialize(akv_context *context, const void *buffer, size_t size,
#                                  akv_cache **out_cache, void *stream);
akv_cache_deserialize = _declare("akv_cache_deserialize", akv_status,
                                 [akv_context_p, c_void_p, c_size_t, POINTER(akv_cache_p),
                                  c_void_p])
# akv_status akv_decode_lse(akv_cache *cache, const void *queries, akv_dtype dtype,
#                           int32_t q_len, void *out, float *out_lse, void *stream);
akv_decode_lse = _declare("akv_decode_lse", akv_status,
                          [akv_cache_p, c_void_p, akv_dtype, c_int32, c_void_p, c_void_p, c_void_p])
# akv_status akv_decode_batch_lse(akv_context *context, akv_cache *const *caches,
#                                 int32_t batch, const void *queries, akv_dtype dtype,
#                                 int32_t q_len, void *out, float *out_lse, void *stream);
akv_decode_batch_lse = _declare("akv_decode_batch_lse", akv_status,
                                [akv_context_p, POINTER(akv_cache_p), c_int32, c_void_p, akv_dtype,
                                 c_int32, c_void_p, c_void_p, c_void_p])

# akv_status akv_cache_compact(akv_cache *cache, const void *queries, akv_dtype dtype,
#                              int64_t headroom_tokens, void *stream);
akv_cache_compact = _declare("akv_cache_compact", akv_status,
                             [akv_cache_p, c_void_p, akv_dtype, c_int64, c_void_p])

# Every function of the header, for the test that checks the declarations are complete.
FUNCTION_NAMES = (
    "akv_version_number", "akv_version_string", "akv_status_string", "akv_last_error_message",
    "akv_context_options_init", "akv_context_create", "akv_context_destroy",
    "akv_compress_options_init", "akv_compress_options_init_method",
    "akv_compress_options_init_paper", "akv_prefill_init", "akv_compressed_size", "akv_compressed_size_model", "akv_compress",
    "akv_cache_destroy", "akv_cache_reserve", "akv_append", "akv_decode", "akv_decode_batch",
    "akv_cache_stats_get", "akv_cache_head_stats", "akv_cache_reconstruct", "akv_cache_logit_penalty",
    "akv_cache_serialized_size", "akv_cache_serialize", "akv_cache_deserialize",
    "akv_decode_lse", "akv_decode_batch_lse",
    "akv_cache_compact",
)
