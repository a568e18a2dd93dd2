/*
 * anchorkv — anchor-residual KV cache compression with compact decode attention.
 *
 * One public header, valid C99. Everything the library exports starts with `akv_` / `AKV_`.
 *
 * Conventions (read once, they hold for every call):
 *  - Every call returns an akv_status; 0 (AKV_OK) is success. On failure
 *    akv_last_error_message() returns a thread-local sentence with the detail, and every
 *    handle passed in is left as it was and stays usable.
 *  - Out parameters come last, just before the stream argument.
 *  - Tensor pointers are host pointers for a CPU context and device pointers for a CUDA
 *    context, unless the parameter says "host". Option structs and stats are always host.
 *  - `stream` is a cudaStream_t passed as void*; NULL is the default stream. CPU contexts
 *    ignore it. Calls that take a stream are asynchronous with respect to the host on CUDA;
 *    on the CPU they complete before returning.
 *  - Token tensors are head-major and contiguous unless strides are given:
 *    [heads][tokens][head_dim]. Prefill inputs accept explicit strides (in elements).
 *  - Queries given to anchorkv are always post-RoPE (what the model attends with). Keys are
 *    pre-RoPE unless the compress options say keys_post_rope.
 *  - Thread safety: one handle must not be used by two threads at once; different handles
 *    (including caches of the same context) may be used concurrently. akv_context is used
 *    read-only by cache calls, except that a CPU context's thread pool serialises calls.
 *  - Option structs start with `struct_size`; call the matching *_init() first, then set
 *    fields. A struct from an older header (smaller struct_size) is accepted; fields it
 *    lacks take their defaults. struct_size 0 or larger than this library knows is rejected.
 */
#ifndef ANCHORKV_ANCHORKV_H
#define ANCHORKV_ANCHORKV_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Export and version ---------------------------------------------------------------- */

#if defined(_WIN32)
#  if defined(ANCHORKV_BUILDING)
#    define AKV_API __declspec(dllexport)
#  else
#    define AKV_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__) || defined(__clang__)
#  define AKV_API __attribute__((visibility("default")))
#else
#  define AKV_API
#endif

#define AKV_VERSION_MAJOR 0
#define AKV_VERSION_MINOR 1
#define AKV_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH, as zstd does. */
#define AKV_VERSION_NUMBER (AKV_VERSION_MAJOR * 10000 + AKV_VERSION_MINOR * 100 + AKV_VERSION_PATCH)
#define AKV_VERSION_STRING "0.1.0"

/* Version of the library actually loaded (compare with AKV_VERSION_NUMBER). */
AKV_API unsigned akv_version_number(void);
AKV_API const char *akv_version_string(void);

/* ---- Status ------------------------------------------------------------------------------ */

/* Values are pinned: they never change meaning across releases. */
typedef enum akv_status {
  AKV_OK = 0,
  AKV_ERR_INVALID_ARGUMENT = 1,     /* NULL pointer, bad size, shape or option value */
  AKV_ERR_UNSUPPORTED = 2,          /* valid request this build/backend/method cannot do */
  AKV_ERR_BUDGET = 3,               /* retain_fraction too small: message names the minimum */
  AKV_ERR_NON_FINITE = 4,           /* NaN or Inf in K, V or Q */
  AKV_ERR_OUT_OF_MEMORY = 5,        /* the allocator returned NULL */
  AKV_ERR_CORRUPT_DATA = 6,         /* serialized data truncated, bad magic or checksum */
  AKV_ERR_VERSION = 7,              /* serialized data from a newer, unknown format */
  AKV_ERR_BACKEND_UNAVAILABLE = 8,  /* backend not compiled in or no device present */
  AKV_ERR_BACKEND = 9,              /* the device runtime reported an error */
  AKV_ERR_MISMATCH = 10,            /* handles or tensors that do not belong together */
  AKV_ERR_CAPACITY = 11,            /* buffer too small (serialize) */
  AKV_ERR_INTERNAL = 12             /* a bug: please report it with the message */
} akv_status;

/* Static English name of a status ("AKV_ERR_BUDGET: ..."), never NULL. */
AKV_API const char *akv_status_string(akv_status status);
/* Detail of the last failed call on this thread; "" when none. Never NULL. Valid until the
 * next anchorkv call on the same thread. */
AKV_API const char *akv_last_error_message(void);

/* ---- Enumerations -------------------------------------------------------------------------- */

typedef enum akv_dtype {
  AKV_DTYPE_AUTO = 0, /* storage only: bf16, or fp16 when the input is fp16 */
  AKV_DTYPE_F32 = 1,
  AKV_DTYPE_F16 = 2,
  AKV_DTYPE_BF16 = 3
} akv_dtype;

typedef enum akv_backend {
  AKV_BACKEND_CPU = 0,
  AKV_BACKEND_CUDA = 1
} akv_backend;

typedef enum akv_method {
  AKV_METHOD_FULLKV = 0,   /* exact dense cache: reference and fallback */
  AKV_METHOD_ANCHORKV = 1, /* anchors + projection coefficients + 2-bit residuals */
  AKV_METHOD_SNAPKV = 2,   /* reserved for the eviction baselines */
  AKV_METHOD_PYRAMIDKV = 3,
  AKV_METHOD_ADAKV = 4,
  AKV_METHOD_ANDPRO = 5,
  AKV_METHOD_QUANTIZED = 6
} akv_method;

typedef enum akv_rope_style {
  AKV_ROPE_NONE = 0, /* no positional rotation (keys used as given) */
  AKV_ROPE_NEOX = 1, /* rotate-half: pairs (i, i + rotary_dim/2) — Llama, Qwen, Mistral */
  AKV_ROPE_GPTJ = 2  /* interleaved: pairs (2i, 2i + 1) */
} akv_rope_style;

typedef enum akv_pool_type {
  AKV_POOL_AVG = 0,
  AKV_POOL_MAX = 1
} akv_pool_type;

/* How a rotated residual is scaled before the 4-level Lloyd-Max codebook (SPEC 2.7).
 * Measured relative distortion on Gaussian residuals, D=128 (tests/core/codec_test.cpp):
 * absmax 0.267, RMS 0.116, least squares 0.115. Least squares is the default. */
typedef enum akv_residual_scale {
  AKV_SCALE_LEAST_SQUARES = 0, /* codes from the RMS scale, then the scale refit by LS */
  AKV_SCALE_RMS = 1,           /* scale = ||y|| / sqrt(D) (unit-variance codebook) */
  AKV_SCALE_ABSMAX = 2         /* outer level placed at the absmax, as the paper words it */
} akv_residual_scale;

/* ---- Context ----------------------------------------------------------------------------- */

typedef struct akv_context akv_context;
typedef struct akv_cache akv_cache;

/* Allocator hooks. For a CPU context they allocate host memory, for a CUDA context device
 * memory on the context's device. Returned blocks must be aligned to at least 256 bytes.
 * `free` receives the size that was requested. Either both are set or neither. */
typedef struct akv_allocator {
  void *(*alloc)(void *user_data, size_t bytes);
  void (*free)(void *user_data, void *ptr, size_t bytes);
  void *user_data;
} akv_allocator;

typedef struct akv_context_options {
  size_t struct_size;     /* sizeof(akv_context_options) */
  akv_backend backend;    /* default AKV_BACKEND_CPU */
  int32_t device;         /* CUDA device ordinal; default 0 */
  int32_t num_threads;    /* CPU worker threads; 0 = all hardware threads */
  akv_allocator allocator;/* all NULL = the library's own (aligned malloc / cudaMalloc) */
} akv_context_options;

AKV_API void akv_context_options_init(akv_context_options *options);
/* options may be NULL (defaults: CPU). */
AKV_API akv_status akv_context_create(const akv_context_options *options,
                                      akv_context **out_context);
/* NULL is a no-op. Every cache of the context must be destroyed first. */
AKV_API void akv_context_destroy(akv_context *context);

/* ---- Compression ------------------------------------------------------------------------- */

/* Rotary embedding of the model. Frozen layout (no struct_size): embedded in options. */
typedef struct akv_rope {
  akv_rope_style style;    /* default AKV_ROPE_NEOX */
  int32_t rotary_dim;      /* rotated dims from the start of each head; 0 = head_dim */
  double base;             /* theta of the frequencies base^(-2i/rotary_dim); default 10000 */
  const float *inv_freq;   /* host; optional rotary_dim/2 frequencies, overrides base
                              (Llama-3, YaRN, linear scaling). Copied at compress time. */
} akv_rope;

typedef struct akv_compress_options {
  size_t struct_size;             /* sizeof(akv_compress_options) */
  akv_method method;              /* default AKV_METHOD_ANCHORKV */
  double retain_fraction;         /* theta in (0,1]: footprint <= theta * 4*S*H*D; 0.05 */
  int32_t window;                 /* W, always-exact recent positions; default 32 */
  int32_t anchors;                /* k per head incl. the window; 0 = max(W, S/128) */
  double scored_fraction;         /* rho: share of k-W chosen by score; default 0.7 */
  int32_t pool_kernel;            /* kappa, odd; default 7 */
  akv_pool_type pool_type;        /* default AKV_POOL_AVG (paper Eq. 14) */
  akv_residual_scale residual_scale; /* default AKV_SCALE_LEAST_SQUARES */
  uint64_t seed;                  /* anchor sampling and Hadamard signs; default 42 */
  int32_t layer_index;            /* keys the sampler; default 0 */
  int32_t layer_count;            /* default 1 */
  akv_rope rope;
  int32_t keys_post_rope;         /* 1: keys carry RoPE already; the library de-rotates */
  float softmax_scale;            /* 0 = 1/sqrt(head_dim) */
  akv_dtype storage_dtype;        /* AUTO, F16 or BF16 (anchors, window, appended) */
} akv_compress_options;

AKV_API void akv_compress_options_init(akv_compress_options *options);

/* Shape of one layer of one request. Frozen layout. */
typedef struct akv_shape {
  int64_t seq_len;        /* S, prompt positions */
  int32_t num_kv_heads;   /* H */
  int32_t num_q_heads;    /* Hq, a multiple of H (GQA group G = Hq/H) */
  int32_t head_dim;       /* D: a power of two in [16, 512] for AnchorKV (codec) */
} akv_shape;

/* The tensors an engine holds at the end of prefill, for one layer. */
typedef struct akv_prefill {
  size_t struct_size;      /* sizeof(akv_prefill) */
  akv_shape shape;
  akv_dtype dtype;         /* F32, F16 or BF16, for keys, values and queries */
  const void *keys;        /* [H][S][D] (see strides) */
  const void *values;      /* [H][S][D] */
  const void *queries;     /* [Hq][W][D] post-RoPE queries of the last W prompt positions;
                              W = options.window. May be NULL for AKV_METHOD_FULLKV. */
  const int32_t *positions;/* optional [S], strictly increasing; NULL = 0..S-1 */
  int64_t kv_head_stride;  /* elements between heads of keys/values; 0 = S*D */
  int64_t kv_token_stride; /* elements between tokens; 0 = D */
  int64_t q_head_stride;   /* 0 = W*D */
  int64_t q_token_stride;  /* 0 = D */
} akv_prefill;

AKV_API void akv_prefill_init(akv_prefill *prefill);

/* Exact bytes the compressed cache will hold for this shape and options, before any data is
 * seen (the footprint of SPEC 3, appended tokens excluded). Lets engines preallocate.
 * Fails with AKV_ERR_BUDGET (message: the smallest workable retain_fraction) when the
 * budget cannot hold the anchors and metadata. */
AKV_API akv_status akv_compressed_size(const akv_compress_options *options,
                                       const akv_shape *shape, size_t *out_bytes);

/* Compress one layer. The inputs are only read during the call (CUDA: until the stream
 * reaches the end of the work); the engine may free them afterwards. options may be NULL
 * (defaults). */
AKV_API akv_status akv_compress(akv_context *context, const akv_prefill *prefill,
                                const akv_compress_options *options, akv_cache **out_cache,
                                void *stream);

/* NULL is a no-op. */
AKV_API void akv_cache_destroy(akv_cache *cache);

/* ---- Appending and decoding -------------------------------------------------------------- */

/* Reserve room for `tokens` appended tokens in total, so that append and decode never
 * allocate afterwards (CUDA-graph capture). */
AKV_API akv_status akv_cache_reserve(akv_cache *cache, int64_t tokens, void *stream);

/* Append `num_tokens` new tokens, stored exactly (dense, storage dtype). keys, values:
 * [H][num_tokens][D] in `dtype`, keys following the cache's keys_post_rope convention.
 * positions: optional host [num_tokens], strictly increasing and above every stored
 * position; NULL = continue from the last position. Grows the reservation if needed. */
AKV_API akv_status akv_append(akv_cache *cache, const void *keys, const void *values,
                              akv_dtype dtype, int32_t num_tokens, const int32_t *positions,
                              void *stream);

/* Attention of q_len new queries over the whole cache (every prompt position, none dropped,
 * plus the appended suffix), with one softmax. queries, out: [Hq][q_len][D] in `dtype`.
 * Query i (0-based) is the token at cache position T - q_len + i, where T is the number of
 * cached tokens: it sees everything but the last q_len - 1 - i appended tokens (causal among
 * the new tokens). Needs q_len - 1 <= appended tokens. */
AKV_API akv_status akv_decode(akv_cache *cache, const void *queries, akv_dtype dtype,
                              int32_t q_len, void *out, void *stream);

/* akv_decode over many caches (requests, possibly different lengths) in one call.
 * All caches belong to `context` and share H, Hq and D. queries, out:
 * [batch][Hq][q_len][D]. */
AKV_API akv_status akv_decode_batch(akv_context *context, akv_cache *const *caches,
                                    int32_t batch, const void *queries, akv_dtype dtype,
                                    int32_t q_len, void *out, void *stream);

/* ---- Inspection -------------------------------------------------------------------------- */

typedef struct akv_cache_stats {
  size_t struct_size;        /* sizeof(akv_cache_stats), set by the caller */
  akv_method method;
  akv_shape shape;
  akv_dtype storage_dtype;
  int32_t window;            /* W */
  int32_t anchors;           /* k per head (AnchorKV) */
  int64_t appended_tokens;
  int64_t append_capacity;
  uint64_t full_bytes;       /* M_full = 4*S*H*D */
  uint64_t budget_bytes;     /* floor(theta * M_full) */
  uint64_t base_bytes;       /* M_base (AnchorKV): anchors and per-token metadata */
  uint64_t compressed_bytes; /* footprint of the compressed prompt; == akv_compressed_size */
  uint64_t appended_bytes;   /* dense suffix in use: 4*appended*H*D */
  uint64_t allocated_bytes;  /* bytes this cache holds through the allocator */
  double ratio;              /* full_bytes / compressed_bytes */
  int64_t key_residuals;     /* residuals stored on the key side, all heads */
  int64_t value_residuals;
} akv_cache_stats;

typedef struct akv_head_stats {
  int64_t kept_tokens;      /* prompt positions represented (S for AnchorKV and FullKV) */
  int64_t anchors;          /* exact tokens (AnchorKV: k) */
  int64_t key_residuals;
  int64_t value_residuals;
} akv_head_stats;

AKV_API akv_status akv_cache_stats_get(const akv_cache *cache, akv_cache_stats *out_stats);
/* Per-head counts; out_heads: host array of H entries. */
AKV_API akv_status akv_cache_head_stats(const akv_cache *cache, akv_head_stats *out_heads);

/* Dense K^ and V^ of every cached token (prompt then appended): [H][T][D] in `dtype`, with
 * T = S + appended. keys come post-RoPE when `rotated` is 1, pre-RoPE when 0. present:
 * optional [H][T] bytes, 1 where the method keeps the token (all 1 unless evicting). For
 * tests and for engines that bring their own attention kernel. */
AKV_API akv_status akv_cache_reconstruct(const akv_cache *cache, akv_dtype dtype,
                                         int32_t rotated, void *keys, void *values,
                                         uint8_t *present, void *stream);

/* ---- Serialization ----------------------------------------------------------------------- */

/* Versioned, checksummed, backend-independent bytes (little-endian). The buffer is host
 * memory for every backend. A cache serialized by one backend deserializes on the other. */
AKV_API akv_status akv_cache_serialized_size(const akv_cache *cache, size_t *out_bytes);
AKV_API akv_status akv_cache_serialize(const akv_cache *cache, void *buffer, size_t capacity,
                                       size_t *out_written, void *stream);
AKV_API akv_status akv_cache_deserialize(akv_context *context, const void *buffer,
                                         size_t size, akv_cache **out_cache, void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ANCHORKV_ANCHORKV_H */
