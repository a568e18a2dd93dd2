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
 *  - "Exact" tokens (AnchorKV anchors and window, FullKV, appended tokens) are exact in the
 *    storage dtype (bf16 or fp16). Keys are stored in the form the method reads them:
 *    AnchorKV anchors pre-RoPE, dense and appended tokens post-RoPE; the other form is
 *    obtained through one fp32 RoPE rotation, so it can differ from the input by rounding.
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
#define AKV_VERSION_MINOR 2
#define AKV_VERSION_PATCH 0
/* MAJOR*10000 + MINOR*100 + PATCH, as zstd does. */
#define AKV_VERSION_NUMBER (AKV_VERSION_MAJOR * 10000 + AKV_VERSION_MINOR * 100 + AKV_VERSION_PATCH)
#define AKV_VERSION_STRING "0.2.0"

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
  AKV_ERR_NON_FINITE = 4,           /* NaN or Inf in K, V or Q, or a value the storage
                                       dtype cannot hold (f32 above 65504 into f16) */
  AKV_ERR_OUT_OF_MEMORY = 5,        /* the allocator returned NULL, or the system refused
                                       memory or a CPU worker thread */
  AKV_ERR_CORRUPT_DATA = 6,         /* serialized data truncated, inconsistent, bad magic
                                       or checksum */
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
  AKV_METHOD_FULLKV = 0,   /* exact dense cache: reference and fallback; keeps every token
                              whatever retain_fraction says (footprint M_full) */
  AKV_METHOD_ANCHORKV = 1, /* anchors + projection coefficients + 2-bit residuals */
  AKV_METHOD_SNAPKV = 2,   /* eviction: top pooled window attention per head */
  AKV_METHOD_PYRAMIDKV = 3,/* eviction: SnapKV scores, budgets decreasing over layers */
  AKV_METHOD_ADAKV = 4,    /* eviction: SnapKV scores, budget shared across heads */
  AKV_METHOD_ANDPRO = 5,   /* eviction: chunks scored by projection on the window output */
  AKV_METHOD_QUANTIZED = 6, /* every token, TurboQuant-style b-bit codes (about 4-6x) */
  /* Evictions of KVPress's presses, at the same matched bytes (appended in 0.3): */
  AKV_METHOD_TOVA = 7,      /* eviction: the last window query's attention, mean over all
                               query heads (one kept set per layer); default window 1 (the
                               last token), as TOVAPress */
  AKV_METHOD_KNORM = 8,     /* eviction: the smallest key norms (KnormPress); no queries */
  AKV_METHOD_STREAMINGLLM = 9 /* eviction: the first sink_tokens and the most recent
                               tokens (StreamingLLMPress: 4 sinks); no queries */
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

/* How a rotated residual is scaled before the 4-level Lloyd-Max codebook (docs/design.md §8).
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

/* The CUDA backend in this version:
 *  - holds AnchorKV, FullKV and the eviction methods' caches in device memory, for head_dim
 *    64, 128 or 256; other caches answer AKV_ERR_UNSUPPORTED (QUANTIZED: use a CPU context);
 *  - akv_decode / akv_decode_batch run the fused compact decode kernels (AnchorKV) or
 *    flash-decoding over the dense caches: splits over the prompt, then (AnchorKV) the
 *    anchor values, then a merge, any batch size (launches of up to 128 requests);
 *  - decode is CUDA-graph safe: the grid depends only on the batch shape and the prompt
 *    lengths, and the appended length is read on the device, so a captured decode replayed
 *    after akv_append sees the new tokens. A captured decode allocates its scratch inside
 *    the graph (a stream-ordered allocation, from the device's default memory pool, not the
 *    context's allocator hooks), so every graph owns its own and may be replayed on any
 *    stream alongside other decodes. Run one decode with the same batch shape (caches,
 *    q_len) before capturing it: it sets the kernels' attributes. Outside capture a decode
 *    uses its stream's workspace, grown when a larger batch shape first runs there (that
 *    synchronises the stream). Compression has its own workspace;
 *  - akv_append writes on the device from device tensors, without scanning them for NaN/Inf
 *    (that would synchronise); reserve capacity first (akv_cache_reserve) so that it never
 *    allocates. akv_cache_reserve, akv_cache_deserialize, akv_cache_serialize and
 *    akv_cache_reconstruct synchronise the stream;
 *  - akv_append may be captured in a graph with the decode (positions NULL; explicit ones are
 *    refused under capture): each replay appends after the cache's last token, its position
 *    read on the device. Reserve room for every replay before capturing. The host's count of
 *    appended tokens catches up at the next call that reads it (stats, reserve, append outside
 *    capture, compact, reconstruct, serialize), which then waits for the device
 *    (cudaDeviceSynchronize); if replays ran past the reservation, the extra tokens were
 *    dropped and that call returns AKV_ERR_CAPACITY once (the cache stays usable; the dropped
 *    tokens' positions stay taken, so that later tokens keep the engine's positions);
 *  - akv_compress runs on the device for every method but QUANTIZED (the same layout as the
 *    CPU; the GPU computes in a different order, so a floating-point near-tie can flip an
 *    anchor, an assignment, a residual or a kept token: rare, and bounded by the GPU
 *    tests). It checks the inputs for NaN/Inf and the eviction methods download their kept
 *    token indices (host metadata), so it waits for its work before returning. */
typedef struct akv_context_options {
  size_t struct_size;     /* sizeof(akv_context_options) */
  akv_backend backend;    /* default AKV_BACKEND_CPU */
  int32_t device;         /* CUDA device ordinal; default 0 */
  int32_t num_threads;    /* CPU worker threads, at most 1024; 0 = all hardware threads
                             (capped at 1024). They are all the CPU backend uses: when the
                             library was built with OpenBLAS, its first GEMM sets OpenBLAS
                             to one thread (openblas_set_num_threads(1), process-wide).
                             Decode outputs and AnchorKV's compressed caches are the
                             same bytes with any count */
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
  double retain_fraction;         /* theta in (0,1]: footprint <= theta * 4*S*H*D; 0.05.
                                     FullKV, the exact reference, validates and ignores it
                                     (footprint and budget_bytes = 4*S*H*D) */
  int32_t window;                 /* W, always-exact recent positions; default 32 */
  int32_t anchors;                /* k per head incl. the window; 0 = automatic (see
                                     anchor_share and fill_budget) */
  double scored_fraction;         /* rho: share of k-W chosen by score (at least scored_min
                                     anchors); default 0.3 (paper 0.7) */
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
  /* ---- Baseline methods (fields appended after the AnchorKV ones; see
   * akv_compress_options_init_method for each method's paper defaults) ---- */
  double adakv_alpha;             /* ADAKV: safeguard share; head h keeps round(cnt_h*(1-alpha)
                                     + alpha*(B-W)) tokens, cnt_h its share of the layer-wide
                                     top-H*(B-W). In [0, 1]; default 0.2 */
  int32_t quant_bits;             /* QUANTIZED: bits per coordinate, 2, 3 or 4; 0 = the most
                                     bits whose footprint fits retain_fraction. Default 0 */
  int32_t quant_outliers;         /* QUANTIZED: largest-|x| channels of each key kept in the
                                     storage dtype (with their index), 0..min(32, D/2); default 4 */
  int32_t pyramid_beta;           /* PYRAMIDKV: the last layer keeps (B-W)/beta evictable tokens
                                     per head (schedule below); >= 1; default 20 */
  int32_t andpro_chunk;           /* ANDPRO: tokens per scored chunk, 1..64; default 4 */
  /* ---- AnchorKV beyond the paper (appended in 0.2). The defaults are the ones measured
   * best on a real model (docs/evaluation.md, "Quality on a real model"); akv_compress_options_init_paper
   * sets them (and scored_fraction) to the paper's behaviour. ---- */
  int32_t sink_tokens;            /* ANCHORKV: the first sink_tokens prompt positions are always
                                     anchors (the attention sink, stored exactly); they take
                                     slots of the scored share (which grows to hold them) and
                                     are capped at k-W. >= 0; default 4. STREAMINGLLM: the
                                     first sink_tokens are always kept; default 4 */
  int32_t fill_budget;            /* ANCHORKV with anchors = 0: 1 = while every non-anchor token
                                     already gets both residuals and budget is left, add anchors
                                     (exact tokens) to spend it, so the footprint follows
                                     retain_fraction at low ratios; 0 = no. Default 1 */
  double anchor_share;            /* ANCHORKV with anchors = 0: k starts from the paper's
                                     max(W, S/128) and grows by as many anchors as this share of
                                     the budget left after M_base pays for (each 4D+8 bytes per
                                     head), clamped to S. In [0, 1]; default 0.7 */
  double guard_fraction;          /* ANCHORKV: share of each side's residual slots that goes,
                                     after the utility ranking (Eq. 6) has filled the rest, to
                                     the tokens with the largest residual energy
                                     ||x - gamma x_a||^2 (query-agnostic: it protects tokens
                                     the window does not look at, such as a needle).
                                     In [0, 1]; default 0.75 */
  int32_t coverage_rounds;        /* ANCHORKV: how the anchors after the scored share are chosen.
                                     0 = a seeded uniform sample (paper); r >= 1 = in r rounds,
                                     the tokens that the anchors so far represent worst (largest
                                     residual energy against their best-|cos| anchor, keys and
                                     values each relative to their mean), each round's from a
                                     pool of 8x as many, skipping those that a worse one would
                                     represent (docs/design.md 2.2). 0..64; default 8 */
  /* ---- Tensor parallelism (appended in 0.2; docs/engines.md) ---- */
  int32_t pool_heads;             /* ANCHORKV: KV heads per residual-pooling group. The call's
                                     heads split into consecutive groups of pool_heads; each group
                                     gets the anchors and residual slots it would get compressed
                                     alone (its own theta * M_full), and its heads compete only
                                     with each other. 0 = one group of every head of the call.
                                     Must divide num_kv_heads. A TP rank compressing its own heads
                                     leaves it 0; a single call that must decode like TP ranks of
                                     pool_heads heads each sets it. Other methods: 0 or H only
                                     (AdaKV and AnDPro pool over the call's heads). Default 0 */
  int32_t head_offset;            /* ANCHORKV: model-wide index of the call's first KV head (TP
                                     rank r of T: r * H). Keys the seeded anchor sample
                                     (coverage_rounds 0) by the model-wide head, so a rank picks
                                     the anchors one call over all heads would. >= 0; default 0 */
  /* ---- Long generations (appended in 0.2; see akv_cache_compact) ---- */
  int64_t compact_after;          /* ANCHORKV, SNAPKV, PYRAMIDKV, ANDPRO on a CPU context:
                                     automatic compaction (akv_cache_compact). 0 = never
                                     (default). n > 0: akv_decode / akv_decode_batch record the
                                     queries they are given, and once the appended suffix holds
                                     more than n tokens (at least window) and the queries of the
                                     last `window` tokens are recorded, the call compacts the
                                     cache after computing its output, with headroom n (a
                                     failed compaction fails the call, with `out` written and
                                     the cache as it was). Queries recorded by decode are not
                                     serialized. CUDA contexts refuse it (compaction
                                     synchronises: call akv_cache_compact between decodes) */
  /* ---- Storage format (appended in 0.3; docs/design.md section 3) ---- */
  int32_t storage_format;         /* ANCHORKV: the layout of the compressed prompt.
                                     3 = local anchor tables: positions cut into segments, each
                                     with a table of at most 256 of the head's anchors, so a
                                     token's key and value anchors are one byte each; 8-bit
                                     log-coded coefficients;
                                     positions implicit (the prompt's positions must be
                                     consecutive). 2 = the paper's layout (u16 anchor indices,
                                     bf16 coefficients, int32 positions; App. A.1). 0 = 3.
                                     akv_compress_options_init_paper sets 2. Both read, decode,
                                     serialize and compact the same way. Default 0 */
  /* ---- Scoring (appended in 0.3; docs/design.md section 2.2) ---- */
  int32_t scored_min;             /* ANCHORKV: the scored share holds at least this many anchors
                                     (capped at k-W): at high ratios scored_fraction*(k-W) is
                                     too few for the places the window attends to (at 4K tokens
                                     and 20x, k-W is about 60). >= 0; default 64 */
  int32_t follow_tokens;          /* ANCHORKV: after pooling, a prompt token's score is the
                                     largest of its own and those of the follow_tokens tokens
                                     before it, so the text right after what the window attends
                                     to is scored with it. The window's question finds where the
                                     answer is written ("the pass key is"), but at answer time
                                     an induction head reads the tokens that follow that match
                                     (the digits). 0 = the paper's pooled score. 0..64; default 8 */
  /* ---- Decode (appended in 0.3; docs/design.md section 4.5) ---- */
  double logit_correction;        /* ANCHORKV, storage format 3: the decode lowers the logit of
                                     every reconstructed prompt token (not an anchor) by
                                     f * |q|^2 * e, q the scaled query and e its head's mean
                                     squared key error per dimension over such tokens (with and
                                     without a key residual apart), measured at compression,
                                     and f per head the one of 0, c/2, c and 2c (c this field)
                                     that brings the attention of the last window rows closest
                                     to their exact attention. A key error e_t the query cannot
                                     see makes exp(q.k^_t) overestimate exp(q.k_t) by
                                     exp(Var(q.e_t)/2) on average, so without it the many
                                     reconstructed tokens draw attention from the exact ones
                                     (at 20x on natural text, the answer). 0.5 removes that
                                     bias for an isotropic error; 0 = attention over
                                     akv_cache_reconstruct exactly (akv_cache_logit_penalty).
                                     [0, 4]; default 0.5; format 2 ignores it */
} akv_compress_options;

/* Defaults for every field; method = AKV_METHOD_ANCHORKV. The AnchorKV fields take the paper's
 * values (B.3: W 32, pooling 7 avg, 2-bit residuals, seed 42) except where a real
 * model (SmolLM2-135M, pass-key prompts of 2K-8K tokens; docs/evaluation.md, "Quality on a real model")
 * measured better, each a deviation from the paper:
 *  - sink_tokens 4: the first positions are always anchors (exact);
 *  - anchor_share 0.7 and fill_budget 1: more anchors than max(W, S/128) where the budget has
 *    room (at 4K tokens the paper's k is the window alone);
 *  - coverage_rounds 8 and scored_fraction 0.3 (paper: rho 0.7): after the scored share, most
 *    anchors are the tokens the others represent worst, not a uniform sample;
 *  - guard_fraction 0.75: most residual slots go by residual energy, the rest by the Eq. 6
 *    utility (which only sees what the window queries attend to);
 *  - follow_tokens 8 and scored_min 64: the tokens after a scored one share its score (on
 *    natural text the window finds the question's match, not the answer that follows it),
 *    and at least 64 anchors are scored;
 *  - logit_correction 0.5: the decode removes the attention that key errors add to the
 *    reconstructed tokens (the paper attends over the reconstruction as it is).
 * akv_compress_options_init_paper gives the paper's setup (these nine fields as the paper). */
AKV_API void akv_compress_options_init(akv_compress_options *options);

/* akv_compress_options_init, then `method` and that method's paper defaults where they differ
 * from AnchorKV's. A caller who only picks the method gets the setup of the paper's baselines
 * (App. B.4, B.5; AnDPro's rebuttal):
 *  - FULLKV, ANCHORKV: as akv_compress_options_init.
 *  - SNAPKV, PYRAMIDKV, ADAKV (KVPress defaults): window 64, pool_kernel 5, AKV_POOL_AVG.
 *  - ANDPRO: window 32, pool_kernel 7, AKV_POOL_MAX, andpro_chunk 4.
 *  - QUANTIZED (the paper's TurboQuant 3.5-bit setup): window 128 exact recent tokens,
 *    quant_bits 3, quant_outliers 4, retain_fraction 1 (a ceiling: the ratio follows from
 *    the bits, about 4.3x at D=128 and S=16K).
 * With akv_compress_options_init instead, the baselines run with the AnchorKV window and
 * pooling (32, 7, avg); every field can be overridden after either call.
 *
 * How the baselines spend retain_fraction (theta) at matched bytes (docs/design.md §5):
 *  - Eviction (SNAPKV, PYRAMIDKV, ADAKV, ANDPRO) keeps exact tokens post-RoPE in the storage
 *    dtype: B = floor(theta*S) tokens per head on average, the window included, so the
 *    footprint is 4*D*(tokens kept) <= theta*4*S*H*D. SnapKV keeps B per head. PyramidKV
 *    gives layer l (layer_index of layer_count) W + b_l per head, b_l linear from
 *    max = 2(B-W) - min at layer 0 to min = (B-W)/pyramid_beta at the last layer (max clamped
 *    to S-W, then min = 2(B-W) - max), so the layers average B while one layer may exceed
 *    theta*M_full (budget_bytes in the stats stays floor(theta*M_full)). AdaKV and AnDPro
 *    keep H*B tokens per layer with a data-dependent split over heads. AnDPro always keeps
 *    the first chunk (attention sink) and the window. Fails with AKV_ERR_BUDGET when B is
 *    below what must always be kept. seq_len must exceed window; queries are required.
 *    Evicted tokens are gone: decode attends over the kept ones; akv_cache_reconstruct
 *    returns zeros and present = 0 for them. The kept tokens' indices are host metadata
 *    (reconstruct, serialization) outside the footprint: decode never reads them.
 *  - QUANTIZED keeps every token: the last `window` tokens exact, the others rotated by the
 *    seeded Hadamard transform of the residual codec; keys get Lloyd-Max codes for N(0,1)
 *    with one fp32 scale plus quant_outliers exact channels, values the same codes and scale
 *    without outliers. queries may be NULL. Fails with AKV_ERR_BUDGET when
 *    the chosen bits (or, with quant_bits 0, 2 bits) do not fit theta*M_full.
 *  - Among the baselines, layer_index / layer_count only shape PyramidKV's schedule (one
 *    layer: SnapKV's budget). */
AKV_API void akv_compress_options_init_method(akv_compress_options *options, akv_method method);

/* akv_compress_options_init with the AnchorKV paper's own settings (B.3): no sink anchors,
 * k = max(W, S/128), no budget filling, rho 0.7 with a uniform sample for the rest, residual
 * slots by the Eq. 6 utility alone, the paper's storage layout (storage_format 2). The preset
 * for comparisons with the paper. */
AKV_API void akv_compress_options_init_paper(akv_compress_options *options);

/* Shape of one layer of one request. Frozen layout. */
typedef struct akv_shape {
  int64_t seq_len;        /* S, prompt positions */
  int32_t num_kv_heads;   /* H, at most 4096 */
  int32_t num_q_heads;    /* Hq, a multiple of H (GQA group G = Hq/H), at most 65536 */
  int32_t head_dim;       /* D. AnchorKV and QUANTIZED: a multiple of 16 in [16, 512]; the
                             codec pads a D that is not a power of two (80, 96, 112) with
                             zeros to the next one (128), and its codes are that long
                             (docs/engines.md); the CUDA backend takes 64, 128
                             and 256 only */
} akv_shape;

/* The tensors an engine holds at the end of prefill, for one layer. */
typedef struct akv_prefill {
  size_t struct_size;      /* sizeof(akv_prefill) */
  akv_shape shape;
  akv_dtype dtype;         /* F32, F16 or BF16, for keys, values and queries */
  const void *keys;        /* [H][S][D] (see strides) */
  const void *values;      /* [H][S][D] */
  const void *queries;     /* [Hq][W][D] post-RoPE queries of the last W prompt positions;
                              W = options.window. May be NULL for AKV_METHOD_FULLKV,
                              QUANTIZED, KNORM and STREAMINGLLM. */
  const int32_t *positions;/* optional host [S], strictly increasing, >= 0; NULL = 0..S-1.
                              AnchorKV stores the window with its first position only: the
                              last `window` positions must be consecutive, else
                              AKV_ERR_UNSUPPORTED (left padding and offsets are fine). In
                              storage format 3 (the default) all of them must be consecutive
                              (any first position); gapped positions need storage_format 2. */
  int64_t kv_head_stride;  /* elements between heads of keys/values; 0 = S*D */
  int64_t kv_token_stride; /* elements between tokens; 0 = D */
  int64_t q_head_stride;   /* 0 = W*D */
  int64_t q_token_stride;  /* 0 = D */
  /* ---- Paged keys and values (appended in 0.2): the block layout of vLLM and SGLang ----
   * With block_table set, keys and values point at block 0 of the engine's paged K and V
   * tensors and token t of this request lives in block block_table[t / block_size], row
   * t % block_size: element (h, t, d) is at
   *   block_table[t / block_size] * kv_block_stride + (t % block_size) * kv_token_stride
   *   + h * kv_head_stride + d.
   * Zero strides then mean vLLM's [num_blocks][block_size][H][D]: kv_head_stride = D,
   * kv_token_stride = H*D, kv_block_stride = block_size*kv_token_stride. Nothing is gathered
   * or copied: both backends read through the table. Queries stay as above. */
  const int32_t *block_table; /* host [ceil(S / block_size)] block ids of this request in token
                                 order, each in [0, num_blocks); NULL = not paged */
  int32_t block_size;         /* tokens per block, >= 1 when paged; 0 otherwise */
  int32_t num_blocks;         /* blocks the K/V tensors hold (bounds the ids); >= 1 when paged */
  int64_t kv_block_stride;    /* elements between blocks; 0 = block_size * kv_token_stride */
} akv_prefill;

AKV_API void akv_prefill_init(akv_prefill *prefill);

/* Exact bytes the compressed cache will hold for this shape and options, before any data is
 * seen (the footprint of docs/design.md §3, appended tokens excluded). Lets engines preallocate.
 * Fails with AKV_ERR_BUDGET (message: the smallest workable retain_fraction) when the
 * budget cannot hold the anchors and metadata. */
AKV_API akv_status akv_compressed_size(const akv_compress_options *options,
                                       const akv_shape *shape, size_t *out_bytes);

/* Exact compressed bytes of a whole model for one request, before prefill, so that an engine
 * can size its memory pool: the sum over layers l = 0..num_layers-1 of akv_compressed_size
 * with layer_index = l, layer_count = num_layers and, when retain_fractions is given,
 * retain_fraction = retain_fractions[l] (options->layer_index/layer_count are ignored).
 * Every layer has `shape`. retain_fractions: optional host [num_layers]; out_layer_bytes:
 * optional host [num_layers], each layer's bytes. Fails like akv_compressed_size, naming the
 * layer. Appended tokens are extra: 4*H*D bytes per token and layer (akv_cache_reserve). */
AKV_API akv_status akv_compressed_size_model(const akv_compress_options *options, const akv_shape *shape,
                                             int32_t num_layers, const double *retain_fractions,
                                             size_t *out_layer_bytes, size_t *out_total_bytes);

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
 * the new tokens). Needs q_len - 1 <= appended tokens.
 * Precision follows `dtype` on a CUDA context: with BF16 queries the key side (rotation of
 * the anchor rows, the query-key products on the tensor cores) runs in bf16 with fp32
 * accumulation, as a bf16 attention kernel does (logits within a few bf16 units of the
 * reconstruction's); with F32 or F16 queries it keeps fp32-level accuracy. The CPU backend
 * computes in fp32 either way. */
AKV_API akv_status akv_decode(akv_cache *cache, const void *queries, akv_dtype dtype,
                              int32_t q_len, void *out, void *stream);

/* akv_decode over many caches (requests, possibly different lengths) in one call.
 * All caches belong to `context` and share H, Hq and D. queries, out:
 * [batch][Hq][q_len][D]. */
AKV_API akv_status akv_decode_batch(akv_context *context, akv_cache *const *caches,
                                    int32_t batch, const void *queries, akv_dtype dtype,
                                    int32_t q_len, void *out, void *stream);

/* Fold the appended suffix into the compressed form (long generations). Afterwards the cache
 * is the one-layer AnchorKV form of all T = S + appended tokens, as akv_compress would build it
 * from K/V of length T, with an empty suffix: stats.shape.seq_len becomes T, the last `window`
 * tokens become the exact window, and later tokens are appended (dense) after them.
 *  - queries: [Hq][window][D] in `dtype`, the post-RoPE queries of the last `window` cached
 *    tokens (what akv_compress takes at prefill); they score the new anchors and residuals.
 *  - AnchorKV: the prompt's anchors and its window stay anchors (stored exactly) as far as
 *    the new anchor count has room, the most leaned-on (assigned tokens) first; the slots left
 *    go to appended tokens (the scored share by window attention, the rest for coverage, as at
 *    prefill). An old token keeps its anchor and coefficient while that anchor stays (its
 *    residual re-encoded from its own codes), else it is re-assigned from its reconstruction
 *    (gamma x_a + residual); appended tokens are assigned from their exact values. Residual
 *    slots of old and new tokens compete in one pool per side, as at prefill. The anchor
 *    count is the automatic one at T, or the old count when that is larger and fits.
 *  - Budget: with headroom_tokens = 0 the footprint is at most theta * 4*T*H*D (theta = the
 *    retain_fraction the cache was compressed with). headroom_tokens = n > 0 leaves room for n
 *    dense tokens appended afterwards: the compressed form gets theta*4*T*H*D minus
 *    (1 - theta)*4*n*H*D, so that compressed + dense suffix stays within theta of M_full at
 *    every step until the suffix exceeds n tokens (compact again then). AKV_ERR_BUDGET (cache
 *    unchanged) when that leaves less than the anchors and metadata need.
 *  - Needs at least `window` appended tokens whose last `window` positions are consecutive
 *    (AnchorKV). The suffix reservation is kept.
 *  - SNAPKV, PYRAMIDKV, ANDPRO: the decode-time variant of eviction (AnDPro's rebuttal: online
 *    updates during decoding at the same budget): the kept prompt tokens and the appended
 *    ones are scored again with these queries as at prefill, and the method keeps its budget
 *    of T tokens (B = floor(theta' T), theta' as above) among them; an evicted token never
 *    comes back. ADAKV (no decode-time variant), FULLKV and QUANTIZED: AKV_ERR_UNSUPPORTED.
 *  - Cost: one compression of T tokens from the reconstruction (O(T), not O(appended)).
 *  - CUDA: the cache is staged through host memory (copied down, compacted by the CPU code,
 *    copied back to new device buffers): the call synchronises `stream`, allocates, and must
 *    not run while `stream` is being captured; captured decodes of this cache must be
 *    re-captured afterwards (its buffers move). Decodes around it stay graph-safe.
 * On failure the cache is unchanged. */
AKV_API akv_status akv_cache_compact(akv_cache *cache, const void *queries, akv_dtype dtype,
                                     int64_t headroom_tokens, void *stream);

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
  uint64_t budget_bytes;     /* floor(theta * M_full); FullKV: M_full (theta ignored) */
  uint64_t base_bytes;       /* M_base (AnchorKV): anchors and per-token metadata */
  uint64_t compressed_bytes; /* footprint of the compressed prompt; == akv_compressed_size */
  uint64_t appended_bytes;   /* dense suffix in use: 4*appended*H*D */
  uint64_t allocated_bytes;  /* bytes this cache holds through the allocator */
  double ratio;              /* full_bytes / compressed_bytes */
  int64_t key_residuals;     /* residuals stored on the key side, all heads */
  int64_t value_residuals;
  int64_t compactions;       /* akv_cache_compact calls folded into this cache (0.2) */
  int32_t storage_format;    /* AnchorKV: 2 or 3 (akv_compress_options.storage_format); 0 for
                                the other methods (0.3) */
  int32_t segment_tokens;    /* AnchorKV format 3: positions per segment; 0 otherwise (0.3) */
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
/* What the decode subtracts from each cached token's logit per |s q|^2 (s the softmax scale,
 * q the query): out [H][T] floats in host memory, T as akv_cache_reconstruct. With
 * akv_cache_reconstruct's post-RoPE keys, akv_decode is softmax_t(s q.k_t - out[h][t] |s q|^2)
 * over the values. Non-zero only for the reconstructed prompt tokens of an AnchorKV cache in
 * storage format 3 compressed with logit_correction > 0 (akv_compress_options); 0 for exact
 * tokens (anchors, window, appended) and for every other cache. */
AKV_API akv_status akv_cache_logit_penalty(const akv_cache *cache, float *out, void *stream);

/* ---- Serialization ----------------------------------------------------------------------- */

/* Versioned, checksummed, backend-independent bytes (little-endian). The buffer is host
 * memory for every backend. A cache serialized by one backend deserializes on the other. */
AKV_API akv_status akv_cache_serialized_size(const akv_cache *cache, size_t *out_bytes);
/* Writes akv_cache_serialized_size() bytes; AKV_ERR_CAPACITY when `capacity` is smaller.
 * out_written may be NULL. */
AKV_API akv_status akv_cache_serialize(const akv_cache *cache, void *buffer, size_t capacity,
                                       size_t *out_written, void *stream);
AKV_API akv_status akv_cache_deserialize(akv_context *context, const void *buffer,
                                         size_t size, akv_cache **out_cache, void *stream);

/* ---- Decode with the log-sum-exp (appended in 0.2) ---------------------------------------- */

/* akv_decode / akv_decode_batch that also return the log-sum-exp of every output row, so an
 * engine can merge this attention over the cache with its own attention over other tokens
 * (cascade or shared-prefix attention) into the attention over the union:
 *   m = max(lse_a, lse_b), w_a = exp(lse_a - m), w_b = exp(lse_b - m),
 *   out = (w_a * out_a + w_b * out_b) / (w_a + w_b),  lse = m + log(w_a + w_b).
 * out_lse: fp32 whatever `dtype` is, [Hq][q_len] (akv_decode_lse) or [batch][Hq][q_len]
 * (akv_decode_batch_lse), same memory space as `out` (device memory for a CUDA context).
 * Row (h, i) holds log(sum_t exp(softmax_scale * q_{h,i} . k_t)) in natural-log units over
 * exactly the tokens that row attends to (the cache's softmax_scale; keys post-RoPE, as
 * akv_cache_reconstruct returns them). out_lse may be NULL: then these calls are
 * akv_decode / akv_decode_batch. Same CUDA-graph and workspace rules as those. */
AKV_API akv_status akv_decode_lse(akv_cache *cache, const void *queries, akv_dtype dtype,
                                  int32_t q_len, void *out, float *out_lse, void *stream);
AKV_API akv_status akv_decode_batch_lse(akv_context *context, akv_cache *const *caches,
                                        int32_t batch, const void *queries, akv_dtype dtype,
                                        int32_t q_len, void *out, float *out_lse, void *stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ANCHORKV_ANCHORKV_H */
