/* Java binding of include/anchorkv/anchorkv.h (SWIG 4).
 *
 *  - Java names: the prefix goes and the rest is lowerCamelCase: akv_version_string ->
 *    AnchorKV.versionString(), retain_fraction -> CompressOptions.setRetainFraction();
 *    AKV_DTYPE_F32 -> DType.F32; the handle and option types become Context, Cache,
 *    CompressOptions, Shape... Javadoc comes from the comments here (swig -doxygen) and the
 *    class comments below.
 *  - Ownership: caches come from %newobject factories (Context.compress, .deserialize) and
 *    are freed by close()/delete() (AutoCloseable), or by a java.lang.ref.Cleaner once
 *    unreachable (NativeHandle; no finalize()); AnchorKV.cacheDestroy and contextDestroy are
 *    the C calls, marked %delobject and releasing the Java proxy. A Cache keeps its Context
 *    alive; Context.close() waits for its last cache.
 *  - Host buffers are direct java.nio.ByteBuffers, read from their start and checked against
 *    the sizes the call needs. Tensors (keys, values, queries, outputs) must be in native byte
 *    order (.order(ByteOrder.nativeOrder())): one in another order (Java's default is big
 *    endian) is refused with IllegalArgumentException rather than read as garbage. Serialized
 *    bytes take any order. Device pointers and CUDA streams are addresses passed as long
 *    (the *Device methods).
 *  - A failed call throws anchorkv.AnchorKVException with the akv_status code and message.
 */
%module(jniclassname="AnchorKVJNI") AnchorKV

%{
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <anchorkv/anchorkv.h>

/* A failure seen by the shims below, turned into a Java exception by %exception. */
static _Thread_local akv_status akv_java_status = AKV_OK;
static _Thread_local char akv_java_message[512];

static int akv_java_fail(akv_status status, const char *message) {
  akv_java_status = status;
  snprintf(akv_java_message, sizeof akv_java_message, "%s", message);
  return 0;
}
/* The library's status: copies its thread-local message before any other call. */
static int akv_java_ok(akv_status status) {
  return status == AKV_OK ? 1 : akv_java_fail(status, akv_last_error_message());
}
static size_t akv_java_element_size(akv_dtype dtype) {
  return dtype == AKV_DTYPE_F32 ? 4 : (dtype == AKV_DTYPE_F16 || dtype == AKV_DTYPE_BF16) ? 2 : 0;
}
/* A buffer holds `count` elements of `element` bytes: else fail with INVALID_ARGUMENT. */
static int akv_java_holds(const char *name, size_t bytes, size_t count, size_t element) {
  char message[160];
  if (bytes / element < count) {
    snprintf(message, sizeof message, "%s holds %zu bytes, the call needs %zu", name, bytes, count * element);
    return akv_java_fail(AKV_ERR_INVALID_ARGUMENT, message);
  }
  return 1;
}
/* A buffer holds `count` elements of dtype. */
static int akv_java_fits(const char *name, size_t bytes, size_t count, akv_dtype dtype) {
  const size_t element = akv_java_element_size(dtype);
  if (!element) return akv_java_fail(AKV_ERR_INVALID_ARGUMENT, "dtype must be F32, F16 or BF16");
  return akv_java_holds(name, bytes, count, element);
}
/* inv_freq tables set from Java are copied into C memory owned by the options, behind their
 * length (the C struct has none), so a compress call can check it against rotary_dim/2. */
typedef struct {
  size_t count;
  float values[];
} akv_java_table;
static akv_java_table *akv_java_table_of(const float *values) {
  return values ? (akv_java_table *)(void *)((char *)(uintptr_t)values - offsetof(akv_java_table, values)) : NULL;
}
static int akv_java_inv_freq_fits(const akv_compress_options *options, int32_t head_dim) {
  const akv_java_table *table = options ? akv_java_table_of(options->rope.inv_freq) : NULL;
  const int32_t rotary_dim = table ? (options->rope.rotary_dim ? options->rope.rotary_dim : head_dim) : 0;
  char message[160];
  if (!table || options->rope.style == AKV_ROPE_NONE || rotary_dim <= 0 || table->count == (size_t)(rotary_dim / 2))
    return 1;
  snprintf(message, sizeof message, "invFreq holds %zu frequencies; rotary_dim %d needs %d", table->count,
           (int)rotary_dim, (int)(rotary_dim / 2));
  return akv_java_fail(AKV_ERR_INVALID_ARGUMENT, message);
}
static int akv_java_shape(const akv_cache *cache, akv_cache_stats *stats) {
  memset(stats, 0, sizeof *stats);
  stats->struct_size = sizeof *stats;
  return akv_java_ok(akv_cache_stats_get(cache, stats));
}
%}

%include <stdint.i>
%include <enums.swg>
%javaconst(1);
%apply int64_t { uint64_t };  /* byte counts fit in a Java long */
%apply int64_t { size_t };

/* ---- Errors: every call checks the shims' status ---------------------------------------- */
%exception {
  akv_java_status = AKV_OK;
  $action
  if (akv_java_status != AKV_OK) {
    jclass error_class = (*jenv)->FindClass(jenv, "anchorkv/AnchorKVException");
    if (error_class) {
      jmethodID constructor = (*jenv)->GetMethodID(jenv, error_class, "<init>", "(ILjava/lang/String;)V");
      jobject error = (*jenv)->NewObject(jenv, error_class, constructor, (jint)akv_java_status,
                                         (*jenv)->NewStringUTF(jenv, akv_java_message));
      if (error) (*jenv)->Throw(jenv, (jthrowable)error);
    }
    return $null;
  }
}

/* ---- Names ---------------------------------------------------------------------------------- */
%rename("%(strip:[akv_])s") "";
/* Java style: struct fields and methods in lowerCamelCase (setRetainFraction, headStats). */
%rename("%(lowercamelcase)s", %$isvariable, %$ismember) "";
%rename("%(lowercamelcase)s", %$isfunction, %$ismember) "";
%rename(versionNumber) akv_version_number;
%rename(versionString) akv_version_string;
%rename(statusString) akv_status_string;
%rename(lastErrorMessage) akv_last_error_message;
%rename(contextDestroy) akv_context_destroy;
%rename(cacheDestroy) akv_cache_destroy;
%rename(compressedBytes) akv_compressed_bytes;
%rename("%(regex:/^AKV_(ERR|DTYPE|BACKEND|METHOD|ROPE|POOL|SCALE)_(.*)$/\\2/)s", %$isenumitem) "";
%rename(OK) AKV_OK;
%rename(Status) akv_status;
%rename(DType) akv_dtype;
%rename(Backend) akv_backend;
%rename(Method) akv_method;
%rename(RopeStyle) akv_rope_style;
%rename(PoolType) akv_pool_type;
%rename(ResidualScale) akv_residual_scale;
%rename(Context) akv_context;
%rename(Cache) akv_cache;
%rename(Rope) akv_rope;
%rename(CompressOptions) akv_compress_options;
%rename(Shape) akv_shape;
%rename(CacheStats) akv_cache_stats;
%rename(HeadStats) akv_head_stats;
/* %extend methods become C functions akv_cache_<name>: these would collide with the API. */
%rename(reserve) akv_cache::reserve_tokens;
%rename(stats) akv_cache::get_stats;
%rename(reconstruct) akv_cache::reconstruct_dense;
%rename(logitPenalty) akv_cache::logit_penalty_into;
%rename(serialize) akv_cache::serialize_into;

/* The raw calls with out-parameters and void* tensors are wrapped as methods below. */
%rename("$ignore", regextarget=1, %$isfunction)
  "^akv_(context_options_init|context_create|compress_options_init|compress_options_init_method|compress_options_init_paper|prefill_init|compressed_size|compressed_size_model|compress|cache_reserve|append|decode|decode_batch|decode_lse|decode_batch_lse|cache_compact|cache_stats_get|cache_head_stats|cache_reconstruct|cache_logit_penalty|cache_serialized_size|cache_serialize|cache_deserialize)$";
%ignore akv_allocator;
%ignore akv_context_options;
%ignore akv_prefill;
%ignore akv_rope::inv_freq;  /* set through CompressOptions.setInvFreq(ByteBuffer) */
/* getRope() only, to change it in place: a setRope(Rope) would copy another table's pointer. */
%immutable akv_compress_options::rope;
%ignore akv_compress_options::struct_size;
%ignore akv_cache_stats::struct_size;

/* ---- Buffers: (pointer, bytes) from one direct ByteBuffer (null allowed) ---------------- */
%typemap(jni) (void *BUFFER, size_t BUFFER_BYTES) "jobject"
%typemap(jtype) (void *BUFFER, size_t BUFFER_BYTES) "java.nio.ByteBuffer"
%typemap(jstype) (void *BUFFER, size_t BUFFER_BYTES) "java.nio.ByteBuffer"
%typemap(javain) (void *BUFFER, size_t BUFFER_BYTES) "$javainput"
%typemap(in) (void *BUFFER, size_t BUFFER_BYTES) {
  $1 = NULL;
  $2 = 0;
  if ($input) {
    $1 = (*jenv)->GetDirectBufferAddress(jenv, $input);
    if (!$1) {
      SWIG_JavaThrowException(jenv, SWIG_JavaIllegalArgumentException, "a direct java.nio.ByteBuffer is required");
      return $null;
    }
    $2 = (size_t)(*jenv)->GetDirectBufferCapacity(jenv, $input);
  }
}

/* Tensors: the same, in native byte order (the library reads host floats and halves as they
 * lie in memory; a big-endian buffer on a little-endian host would be garbage). */
%apply (void *BUFFER, size_t BUFFER_BYTES) { (void *TENSOR, size_t TENSOR_BYTES) };
%typemap(javain,
         pre="    if ($javainput != null && $javainput.order() != java.nio.ByteOrder.nativeOrder())\n"
             "      throw new IllegalArgumentException(\"$javainput must be in native byte order: \"\n"
             "          + \"call .order(java.nio.ByteOrder.nativeOrder()) on it\");")
  (void *TENSOR, size_t TENSOR_BYTES) "$javainput"

/* ---- Ownership ------------------------------------------------------------------------------ */
%nodefaultctor akv_context;
%nodefaultdtor akv_context;
%nodefaultctor akv_cache;
%nodefaultdtor akv_cache;

%typemap(javainterfaces) struct akv_context, struct akv_cache "AutoCloseable"

/* Every owning proxy frees its C object through a NativeHandle: once, by delete()/close() or
 * by a Cleaner when the proxy becomes unreachable. No finalize() (deprecated since Java 9). */
%typemap(javafinalize) SWIGTYPE ""
%typemap(javabody) SWIGTYPE %{
  private transient long swigCPtr;
  protected transient boolean swigCMemOwn;
  private final transient NativeHandle swigHandle;  // null when Java does not own the C object

  protected $javaclassname(long cPtr, boolean cMemoryOwn) {
    swigCMemOwn = cMemoryOwn;
    swigCPtr = cPtr;
    swigHandle = cMemoryOwn && cPtr != 0 ? new NativeHandle(this, cPtr, $imclassname::delete_$javaclassname) : null;
  }

  protected static long getCPtr($javaclassname obj) {
    return (obj == null) ? 0 : obj.swigCPtr;
  }

  protected static long swigRelease($javaclassname obj) {
    long ptr = 0;
    if (obj != null) {
      if (!obj.swigCMemOwn)
        throw new RuntimeException("Cannot release ownership as memory is not owned");
      ptr = obj.swigCPtr;
      obj.swigHandle.disown();
      obj.delete();
    }
    return ptr;
  }
%}
%typemap(javadestruct, methodname="delete", methodmodifiers="public synchronized") SWIGTYPE {
    if (swigCPtr != 0) {
      if (swigCMemOwn) {
        swigCMemOwn = false;
        swigHandle.release();
      }
      swigCPtr = 0;
    }
  }

/* A Context is destroyed when closed and without live caches (the C rule). */
%typemap(javadestruct, methodname="delete", methodmodifiers="public synchronized") struct akv_context {
    closeRequested = true;
    if (liveCaches == 0 && swigCPtr != 0) {
      if (swigCMemOwn) {
        swigCMemOwn = false;
        swigHandle.release();
      }
      swigCPtr = 0;
    }
  }

%typemap(javacode) struct akv_cache %{
  /** Keeps the context alive while this cache lives; the handle lets it go after the C cache. */
  void adoptedBy(Context context) {
    context.cacheOpened();
    swigHandle.then(context::cacheClosed);
  }

  synchronized void releasedByDestroy() {  // after AnchorKV.cacheDestroy freed it
    swigHandle.disown();
    delete();
  }

  /** Frees the cache (idempotent); the context goes too if it was closed and this was its last cache. */
  @Override
  public void close() { delete(); }

  /** Appends numTokens exact tokens at the positions after the last one; see the full overload. */
  public void append(java.nio.ByteBuffer keys, java.nio.ByteBuffer values, DType dtype, int numTokens) {
    append(keys, values, dtype, numTokens, null);
  }

  /** What each KV head keeps, [H] (akv_cache_head_stats). */
  public HeadStats[] headStats() {
    HeadStats[] heads = new HeadStats[(int) stats().getShape().getNumKvHeads()];
    for (int head = 0; head < heads.length; ++head) heads[head] = headStat(head);
    return heads;
  }
%}

/* Every akv_cache* returned to Java is a new cache of `this` context. */
%typemap(javaout) struct akv_cache * {
    long cPtr = $jnicall;
    if (cPtr == 0) return null;
    Cache cache = new Cache(cPtr, $owner);
    cache.adoptedBy(this);
    return cache;
  }

/* The C destroy calls take the handle from Java: %delobject, and the proxy lets go after. */
%delobject akv_cache_destroy;
%delobject akv_context_destroy;
%typemap(javain, post="      if ($javainput != null) $javainput.releasedByDestroy();") akv_cache *DESTROYED
  "Cache.getCPtr($javainput)"
%typemap(javain,
         pre="    if ($javainput != null && $javainput.hasLiveCaches())\n"
             "      throw new IllegalStateException(\"destroy every cache of the context first\");",
         post="      if ($javainput != null) $javainput.swigReleaseOwnership();") akv_context *DESTROYED
  "Context.getCPtr($javainput)"
%typemap(javacode) struct akv_context %{
  private boolean closeRequested;
  private int liveCaches;

  synchronized void cacheOpened() { liveCaches++; }

  synchronized void cacheClosed() {
    if (--liveCaches == 0 && closeRequested) delete();
  }

  synchronized boolean hasLiveCaches() { return liveCaches > 0; }

  synchronized void swigReleaseOwnership() {  // after AnchorKV.contextDestroy freed it
    if (swigHandle != null) swigHandle.disown();
    swigCMemOwn = false;
    swigCPtr = 0;
  }

  /** Releases the context; the C context goes once its last cache is closed too. */
  @Override
  public void close() { delete(); }

  /** Compresses one layer at positions 0..S-1; see the overload with positions. */
  public Cache compress(Shape shape, DType dtype, java.nio.ByteBuffer keys, java.nio.ByteBuffer values,
                        java.nio.ByteBuffer queries, CompressOptions options) {
    return compress(shape, dtype, keys, values, queries, null, options);
  }

  /**
   * Decodes many caches of this context in one call (akv_decode_batch): queries and out are
   * [caches.length][Hq][qLen][D] in native byte order; every cache shares H, Hq and D.
   */
  public void decodeBatch(Cache[] caches, java.nio.ByteBuffer queries, DType dtype, int qLen,
                          java.nio.ByteBuffer out) {
    java.nio.ByteBuffer handles = java.nio.ByteBuffer.allocateDirect(8 * caches.length)
        .order(java.nio.ByteOrder.nativeOrder());
    for (Cache cache : caches) {
      long handle = Cache.getCPtr(cache);
      if (handle == 0) throw new IllegalArgumentException("a cache is null or closed");
      handles.putLong(handle);
    }
    decodeBatchHandles(handles, caches.length, queries, dtype, qLen, out);
    java.lang.ref.Reference.reachabilityFence(caches);
  }
%}
%apply akv_cache *DESTROYED { akv_cache *cache };
%apply akv_context *DESTROYED { akv_context *context };

%newobject akv_context::compress;
%newobject akv_context::compressDevice;
%newobject akv_context::deserialize;
%newobject akv_cache::get_stats;
%newobject akv_cache::head_stat;
%javamethodmodifiers akv_context::decode_batch_handles "private";
/* akv_cache_compact is the C function: the method's C name must differ from it. */
%rename(compact) akv_cache::compact_suffix;

%apply (void *TENSOR, size_t TENSOR_BYTES) {
  (void *keys, size_t keys_bytes), (void *values, size_t values_bytes),
  (void *queries, size_t queries_bytes), (void *out, size_t out_bytes),
  (void *positions, size_t positions_bytes), (void *table, size_t table_bytes),
  (void *lse, size_t lse_bytes)
};
%apply (void *BUFFER, size_t BUFFER_BYTES) {
  (void *bytes, size_t size), (void *buffer, size_t buffer_bytes), (void *handles, size_t handles_bytes)
};

/* ---- Javadoc of the classes (methods: their comments here, through swig -doxygen) ---- */
%pragma(java) moduleclassmodifiers="/**
 * The library's free functions: versions, status names, the exact compressed size, and the
 * C destroy calls (close() on Context and Cache does the same).
 */
public class"
%typemap(javaclassmodifiers) struct akv_context "/**
 * An anchorkv context (akv_context): a backend (CPU or CUDA), a device, worker threads.
 * Compresses layers into caches and decodes batches of them. AutoCloseable; the C context
 * lives until it is closed and its last cache is closed.
 */
public class"
%typemap(javaclassmodifiers) struct akv_cache "/**
 * One compressed layer of one request (akv_cache): append new tokens exactly, decode new
 * queries over every cached token, serialize. AutoCloseable; keeps its Context alive. One
 * thread at a time per cache.
 */
public class"
%typemap(javaclassmodifiers) akv_compress_options "/**
 * Compression options (akv_compress_options): the method and its settings, starting from the
 * library's defaults or a method's paper setup; field setters in the header's units
 * (setRetainFraction, setWindow, getRope().setRotaryDim...).
 */
public class"
%typemap(javaclassmodifiers) akv_shape "/** Shape of one layer of one request (akv_shape): S, H, Hq (a multiple of H), D. */
public class"
%typemap(javaclassmodifiers) akv_rope "/**
 * The model's rotary embedding (akv_rope): style, rotated dimensions (0 = head_dim), base;
 * explicit frequencies through CompressOptions.setInvFreq.
 */
public class"
%typemap(javaclassmodifiers) akv_cache_stats "/** Byte accounting and counts of one cache (akv_cache_stats). */
public class"
%typemap(javaclassmodifiers) akv_head_stats "/** What one KV head keeps (akv_head_stats): kept tokens, anchors, residuals. */
public class"
%typemap(javaclassmodifiers) enum akv_status "/** Status codes (akv_status); AnchorKVException.status() gives one. */
public enum"
%typemap(javaclassmodifiers) enum akv_dtype "/** Element types of tensors (akv_dtype); AUTO only for storage. */
public enum"
%typemap(javaclassmodifiers) enum akv_backend "/** Where a context computes (akv_backend). */
public enum"
%typemap(javaclassmodifiers) enum akv_method "/** Compression methods (akv_method): AnchorKV, the baselines, FullKV. */
public enum"
%typemap(javaclassmodifiers) enum akv_rope_style "/** Rotary embedding layouts (akv_rope_style). */
public enum"
%typemap(javaclassmodifiers) enum akv_pool_type "/** Pooling of window-attention scores (akv_pool_type). */
public enum"
%typemap(javaclassmodifiers) enum akv_residual_scale "/** Scaling of residuals before the 2-bit codebook (akv_residual_scale). */
public enum"

/* Opaque in C; proxy classes in Java. Declared after every typemap they use: C-mode SWIG
 * keys class typemaps on the struct tag, and %extend bodies join the struct's node. */
typedef struct akv_context {} akv_context;
typedef struct akv_cache {} akv_cache;

%extend akv_context {
  /** A context: backend, CUDA device ordinal, CPU threads (0 = all, at most 1024). */
  akv_context(akv_backend backend, int32_t device, int32_t numThreads) {
    akv_context_options options;
    akv_context *context = NULL;
    akv_context_options_init(&options);
    options.backend = backend;
    options.device = device;
    options.num_threads = numThreads;
    akv_java_ok(akv_context_create(&options, &context));
    return context;
  }
  /** A CPU context using every hardware thread. */
  akv_context() {
    akv_context *context = NULL;
    akv_java_ok(akv_context_create(NULL, &context));
    return context;
  }
  ~akv_context() { akv_context_destroy($self); }

  /**
   * Compresses one layer from host buffers (akv_compress).
   * @param shape S, H, Hq, D
   * @param dtype element type of keys, values and queries
   * @param keys [H][S][D], pre-RoPE unless the options say keysPostRope
   * @param values [H][S][D]
   * @param queries [Hq][W][D], post-RoPE queries of the last W = options.getWindow()
   *     positions; null for FullKV and QUANTIZED
   * @param positions [S] int32 token positions, strictly increasing; null for 0..S-1
   * @param options the method and its settings; null for the defaults
   * @return a new cache, which keeps this context alive
   */
  akv_cache *compress(const akv_shape *shape, akv_dtype dtype, void *keys, size_t keys_bytes,
                      void *values, size_t values_bytes, void *queries, size_t queries_bytes,
                      void *positions, size_t positions_bytes, const akv_compress_options *options) {
    akv_prefill prefill;
    akv_cache *cache = NULL;
    const size_t kv = (size_t)shape->num_kv_heads * (size_t)shape->seq_len * (size_t)shape->head_dim;
    const size_t window = options ? (size_t)options->window : 32;
    if (!akv_java_fits("keys", keys_bytes, kv, dtype) || !akv_java_fits("values", values_bytes, kv, dtype))
      return NULL;
    if (queries && !akv_java_fits("queries", queries_bytes,
                                  (size_t)shape->num_q_heads * window * (size_t)shape->head_dim, dtype))
      return NULL;
    if (positions && !akv_java_holds("positions", positions_bytes, (size_t)shape->seq_len, sizeof(int32_t)))
      return NULL;
    if (!akv_java_inv_freq_fits(options, shape->head_dim)) return NULL;
    akv_prefill_init(&prefill);
    prefill.shape = *shape;
    prefill.dtype = dtype;
    prefill.keys = keys;
    prefill.values = values;
    prefill.queries = queries;
    prefill.positions = positions;
    akv_java_ok(akv_compress($self, &prefill, options, &cache, NULL));
    return cache;
  }

  /** Compress from device addresses (CUDA context), contiguous, on `stream` (0 = default). */
  akv_cache *compressDevice(const akv_shape *shape, akv_dtype dtype, int64_t keys, int64_t values,
                            int64_t queries, const akv_compress_options *options, int64_t stream) {
    akv_prefill prefill;
    akv_cache *cache = NULL;
    akv_prefill_init(&prefill);
    prefill.shape = *shape;
    prefill.dtype = dtype;
    prefill.keys = (const void *)(intptr_t)keys;
    prefill.values = (const void *)(intptr_t)values;
    prefill.queries = (const void *)(intptr_t)queries;
    if (!akv_java_inv_freq_fits(options, shape->head_dim)) return NULL;
    akv_java_ok(akv_compress($self, &prefill, options, &cache, (void *)(intptr_t)stream));
    return cache;
  }

  /** A cache from serialized bytes (akv_cache_deserialize). */
  akv_cache *deserialize(void *bytes, size_t size) {
    akv_cache *cache = NULL;
    akv_java_ok(akv_cache_deserialize($self, bytes, size, &cache, NULL));
    return cache;
  }

  /* decodeBatch's C half: `handles` holds `batch` akv_cache addresses. */
  void decode_batch_handles(void *handles, size_t handles_bytes, int32_t batch, void *queries,
                            size_t queries_bytes, akv_dtype dtype, int32_t qLen, void *out,
                            size_t out_bytes) {
    akv_cache *const *caches = (akv_cache *const *)handles;
    akv_cache_stats stats;
    size_t count;
    if (batch < 1) {
      akv_java_fail(AKV_ERR_INVALID_ARGUMENT, "decodeBatch needs at least one cache");
      return;
    }
    if (!akv_java_holds("handles", handles_bytes, (size_t)batch, sizeof(akv_cache *)) ||
        !akv_java_shape(caches[0], &stats))
      return;
    /* The library checks that every cache shares H, Hq and D with the first. */
    count = (size_t)batch * (size_t)stats.shape.num_q_heads * (size_t)(qLen > 0 ? qLen : 0) *
            (size_t)stats.shape.head_dim;
    if (akv_java_fits("queries", queries_bytes, count, dtype) && akv_java_fits("out", out_bytes, count, dtype))
      akv_java_ok(akv_decode_batch($self, caches, batch, queries, dtype, qLen, out, NULL));
  }
}

%extend akv_cache {
  ~akv_cache() { akv_cache_destroy($self); }

  /** Room for `tokens` appended tokens in total, so append and decode never allocate. */
  void reserve_tokens(int64_t tokens) { akv_java_ok(akv_cache_reserve($self, tokens, NULL)); }

  /**
   * Appends numTokens exact tokens (akv_append).
   * @param keys [H][numTokens][D], pre-RoPE
   * @param values [H][numTokens][D]
   * @param positions [numTokens] int32, strictly increasing and above every stored position;
   *     null to continue after the last one
   */
  void append(void *keys, size_t keys_bytes, void *values, size_t values_bytes, akv_dtype dtype,
              int32_t numTokens, void *positions, size_t positions_bytes) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t tokens = (size_t)(numTokens > 0 ? numTokens : 0);
    const size_t count = (size_t)stats.shape.num_kv_heads * tokens * (size_t)stats.shape.head_dim;
    if (akv_java_fits("keys", keys_bytes, count, dtype) && akv_java_fits("values", values_bytes, count, dtype) &&
        (!positions || akv_java_holds("positions", positions_bytes, tokens, sizeof(int32_t))))
      akv_java_ok(akv_append($self, keys, values, dtype, numTokens, positions, NULL));
  }

  /** What KV head `head` keeps (akv_cache_head_stats); see headStats() for all heads. */
  akv_head_stats *head_stat(int32_t head) {
    akv_cache_stats stats;
    akv_head_stats *heads, *one;
    if (!akv_java_shape($self, &stats)) return NULL;
    if (head < 0 || head >= stats.shape.num_kv_heads) {
      akv_java_fail(AKV_ERR_INVALID_ARGUMENT, "head is not in [0, H)");
      return NULL;
    }
    heads = calloc((size_t)stats.shape.num_kv_heads, sizeof *heads);
    one = calloc(1, sizeof *one);
    if (!heads || !one) {
      free(heads);
      free(one);
      akv_java_fail(AKV_ERR_OUT_OF_MEMORY, "no memory for the head stats");
      return NULL;
    }
    if (akv_java_ok(akv_cache_head_stats($self, heads))) *one = heads[head];
    free(heads);
    if (akv_java_status != AKV_OK) {
      free(one);
      return NULL;
    }
    return one;
  }

  /**
   * Attention of qLen new queries over every cached token (akv_decode); query i is the token
   * at position T - qLen + i (causal among the new tokens).
   * @param queries [Hq][qLen][D], post-RoPE
   * @param out [Hq][qLen][D], written
   */
  void decode(void *queries, size_t queries_bytes, akv_dtype dtype, int32_t qLen, void *out,
              size_t out_bytes) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t count = (size_t)stats.shape.num_q_heads * (size_t)(qLen > 0 ? qLen : 0) *
                         (size_t)stats.shape.head_dim;
    if (akv_java_fits("queries", queries_bytes, count, dtype) && akv_java_fits("out", out_bytes, count, dtype))
      akv_java_ok(akv_decode($self, queries, dtype, qLen, out, NULL));
  }

  /**
   * decode, and each output row's log-sum-exp (akv_decode_lse): the natural log of the row's
   * softmax denominator over the tokens it attends to (logits scaled by the cache's
   * softmax_scale), to merge this attention with attention over other tokens.
   * @param queries [Hq][qLen][D], post-RoPE
   * @param out [Hq][qLen][D], written
   * @param lse [Hq][qLen] float32, written
   */
  void decodeLse(void *queries, size_t queries_bytes, akv_dtype dtype, int32_t qLen, void *out,
                 size_t out_bytes, void *lse, size_t lse_bytes) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t rows = (size_t)stats.shape.num_q_heads * (size_t)(qLen > 0 ? qLen : 0);
    const size_t count = rows * (size_t)stats.shape.head_dim;
    if (akv_java_fits("queries", queries_bytes, count, dtype) && akv_java_fits("out", out_bytes, count, dtype) &&
        akv_java_holds("lse", lse_bytes, rows, sizeof(float)))
      akv_java_ok(akv_decode_lse($self, queries, dtype, qLen, out, (float *)lse, NULL));
  }

  /**
   * Folds the appended tokens, except the last window, back into the compressed form
   * (akv_cache_compact): AnchorKV, and the decode-time variant of SnapKV, PyramidKV and AnDPro.
   * @param queries [Hq][W][D], the post-RoPE queries of the last W positions
   * @param headroomTokens dense tokens that may be appended afterwards within the budget
   */
  void compact_suffix(void *queries, size_t queries_bytes, akv_dtype dtype, int64_t headroomTokens) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t count = (size_t)stats.shape.num_q_heads * (size_t)stats.window * (size_t)stats.shape.head_dim;
    if (akv_java_fits("queries", queries_bytes, count, dtype))
      akv_java_ok(akv_cache_compact($self, queries, dtype, headroomTokens, NULL));
  }

  /** decode with device addresses (CUDA context) on `stream` (0 = default). */
  void decodeDevice(int64_t queries, akv_dtype dtype, int32_t qLen, int64_t out, int64_t stream) {
    akv_java_ok(akv_decode($self, (const void *)(intptr_t)queries, dtype, qLen, (void *)(intptr_t)out,
                           (void *)(intptr_t)stream));
  }

  /** Byte accounting and counts (akv_cache_stats_get, a new CacheStats). */
  akv_cache_stats *get_stats() {
    akv_cache_stats *stats = calloc(1, sizeof *stats);
    if (!stats) {
      akv_java_fail(AKV_ERR_OUT_OF_MEMORY, "no memory for the stats");
      return NULL;
    }
    if (!akv_java_shape($self, stats)) {
      free(stats);
      return NULL;
    }
    return stats;
  }

  /** Dense keys (post-RoPE when rotated) and values of every cached token: [H][T][D]. */
  void reconstruct_dense(akv_dtype dtype, bool rotated, void *keys, size_t keys_bytes, void *values,
                   size_t values_bytes) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t count = (size_t)stats.shape.num_kv_heads * (size_t)(stats.shape.seq_len + stats.appended_tokens) *
                         (size_t)stats.shape.head_dim;
    if (akv_java_fits("keys", keys_bytes, count, dtype) && akv_java_fits("values", values_bytes, count, dtype))
      akv_java_ok(akv_cache_reconstruct($self, dtype, rotated ? 1 : 0, keys, values, NULL, NULL));
  }

  /** What decode subtracts from each token's logit per |s q|^2 (s the softmax scale), [H][T]
   * floats (akv_cache_logit_penalty): with reconstruct()'s rotated keys, decode is
   * softmax(s q.k_t - out[h][t] |s q|^2) over the values. */
  void logit_penalty_into(void *out, size_t out_bytes) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t count = (size_t)stats.shape.num_kv_heads * (size_t)(stats.shape.seq_len + stats.appended_tokens);
    if (akv_java_fits("out", out_bytes, count, AKV_DTYPE_F32)) akv_java_ok(akv_cache_logit_penalty($self, out, NULL));
  }

  /** Bytes serialize() writes (akv_cache_serialized_size). */
  int64_t serializedSize() {
    size_t bytes = 0;
    akv_java_ok(akv_cache_serialized_size($self, &bytes));
    return (int64_t)bytes;
  }

  /** Serialize into `buffer` (its capacity is the limit); returns the bytes written. */
  int64_t serialize_into(void *buffer, size_t buffer_bytes) {
    size_t written = 0;
    if (!buffer) {
      akv_java_fail(AKV_ERR_INVALID_ARGUMENT, "buffer is null");
      return 0;
    }
    akv_java_ok(akv_cache_serialize($self, buffer, buffer_bytes, &written, NULL));
    return (int64_t)written;
  }
}

%extend akv_compress_options {
  /** The library's defaults (akv_compress_options_init): AnchorKV, retainFraction 0.05, window 32. */
  akv_compress_options() {
    akv_compress_options *options = calloc(1, sizeof *options);
    if (options) akv_compress_options_init(options);
    return options;
  }
  /** The paper's setup of `method` (akv_compress_options_init_method): SnapKV's window 64... */
  akv_compress_options(akv_method method) {
    akv_compress_options *options = calloc(1, sizeof *options);
    if (options) akv_compress_options_init_method(options, method);
    return options;
  }
  ~akv_compress_options() {
    free(akv_java_table_of($self->rope.inv_freq));
    free($self);
  }
  /**
   * Sets the RoPE inverse frequencies (getRope().getRotaryDim()/2 float32 values, rotary dim 0
   * meaning head_dim; native byte order), e.g. Llama-3's or YaRN's scaled table; they
   * override getRope().getBase(). The table is copied; null clears it. A table of another
   * length than the layer needs is refused when compressing.
   */
  void set_inv_freq(void *table, size_t table_bytes) {
    akv_java_table *copy = NULL;
    if (table) {
      const size_t count = table_bytes / sizeof(float);
      copy = malloc(sizeof *copy + count * sizeof(float));
      if (!copy) {
        akv_java_fail(AKV_ERR_OUT_OF_MEMORY, "no memory for the inv_freq table");
        return;
      }
      copy->count = count;
      memcpy(copy->values, table, count * sizeof(float));
    }
    free(akv_java_table_of($self->rope.inv_freq));
    $self->rope.inv_freq = copy ? copy->values : NULL;
  }

}

%extend akv_shape {
  /** A shape: S prompt positions, H KV heads, Hq query heads (a multiple of H), head dim D. */
  akv_shape(int64_t seqLen, int32_t numKvHeads, int32_t numQHeads, int32_t headDim) {
    akv_shape *shape = calloc(1, sizeof *shape);
    if (shape) {
      shape->seq_len = seqLen;
      shape->num_kv_heads = numKvHeads;
      shape->num_q_heads = numQHeads;
      shape->head_dim = headDim;
    }
    return shape;
  }
}

%inline %{
/** Exact bytes a compressed cache of this shape will hold (akv_compressed_size). */
int64_t akv_compressed_bytes(const akv_compress_options *options, const akv_shape *shape) {
  size_t bytes = 0;
  if (!akv_java_inv_freq_fits(options, shape->head_dim)) return 0;
  akv_java_ok(akv_compressed_size(options, shape, &bytes));
  return (int64_t)bytes;
}
%}

%include <anchorkv/anchorkv.h>

%clear (void *keys, size_t keys_bytes), (void *values, size_t values_bytes),
       (void *queries, size_t queries_bytes), (void *out, size_t out_bytes), (void *bytes, size_t size),
       (void *buffer, size_t buffer_bytes), (void *positions, size_t positions_bytes),
       (void *table, size_t table_bytes), (void *handles, size_t handles_bytes), (void *lse, size_t lse_bytes);
%clear akv_cache *cache;
%clear akv_context *context;
