/* Java binding of include/anchorkv/anchorkv.h (SWIG 4).
 *
 *  - Names lose their prefix: akv_version_string -> AnchorKV.version_string(), AKV_DTYPE_F32 ->
 *    DType.F32; the handle and option types become Context, Cache, CompressOptions, Shape...
 *  - Ownership: caches come from %newobject factories (Context.compress, .deserialize) and
 *    are freed by close()/delete() (AutoCloseable) or the collector; AnchorKV.cache_destroy
 *    and context_destroy are the C calls, marked %delobject and releasing the Java proxy.
 *    A Cache keeps its Context alive; Context.close() waits for its last cache.
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
/* A buffer holds `count` elements of dtype: else fail with INVALID_ARGUMENT. */
static int akv_java_fits(const char *name, size_t bytes, size_t count, akv_dtype dtype) {
  char message[160];
  const size_t element = akv_java_element_size(dtype);
  if (!element) return akv_java_fail(AKV_ERR_INVALID_ARGUMENT, "dtype must be F32, F16 or BF16");
  if (bytes / element < count) {
    snprintf(message, sizeof message, "%s holds %zu bytes, the call needs %zu", name, bytes, count * element);
    return akv_java_fail(AKV_ERR_INVALID_ARGUMENT, message);
  }
  return 1;
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
%rename(serialize) akv_cache::serialize_into;

/* The raw calls with out-parameters and void* tensors are wrapped as methods below. */
%rename("$ignore", regextarget=1, %$isfunction)
  "^akv_(context_options_init|context_create|compress_options_init|compress_options_init_method|prefill_init|compressed_size|compress|cache_reserve|append|decode|decode_batch|decode_lse|decode_batch_lse|cache_stats_get|cache_head_stats|cache_reconstruct|cache_serialized_size|cache_serialize|cache_deserialize)$";
%ignore akv_allocator;
%ignore akv_context_options;
%ignore akv_prefill;
%ignore akv_rope::inv_freq;  /* Java sets the base; tables need the C API */
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

/* A Context is destroyed when closed and without live caches (the C rule). */
%typemap(javadestruct, methodname="delete", methodmodifiers="public synchronized") struct akv_context {
    closeRequested = true;
    if (liveCaches == 0 && swigCPtr != 0) {
      if (swigCMemOwn) {
        swigCMemOwn = false;
        $jnicall;
      }
      swigCPtr = 0;
    }
  }

%typemap(javacode) struct akv_cache %{
  private Context owner;  // keeps the context alive while this cache lives

  void adoptedBy(Context context) {
    owner = context;
    context.cacheOpened();
  }

  synchronized void releasedByDestroy() {  // after AnchorKV.cache_destroy freed it
    swigCMemOwn = false;
    swigCPtr = 0;
    if (owner != null) { owner.cacheClosed(); owner = null; }
  }

  @Override
  public void close() { delete(); }
%}
%typemap(javadestruct, methodname="delete", methodmodifiers="public synchronized") struct akv_cache {
    if (swigCPtr != 0) {
      if (swigCMemOwn) {
        swigCMemOwn = false;
        $jnicall;
      }
      swigCPtr = 0;
      if (owner != null) { owner.cacheClosed(); owner = null; }
    }
  }

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

  synchronized void swigReleaseOwnership() {  // after AnchorKV.context_destroy freed it
    swigCMemOwn = false;
    swigCPtr = 0;
  }

  /** Releases the context; the C context goes once its last cache is closed too. */
  @Override
  public void close() { delete(); }
%}
%apply akv_cache *DESTROYED { akv_cache *cache };
%apply akv_context *DESTROYED { akv_context *context };

%newobject akv_context::compress;
%newobject akv_context::compressDevice;
%newobject akv_context::deserialize;
%newobject akv_cache::get_stats;

%apply (void *TENSOR, size_t TENSOR_BYTES) {
  (void *keys, size_t keys_bytes), (void *values, size_t values_bytes),
  (void *queries, size_t queries_bytes), (void *out, size_t out_bytes)
};
%apply (void *BUFFER, size_t BUFFER_BYTES) { (void *bytes, size_t size), (void *buffer, size_t buffer_bytes) };

/* Opaque in C; proxy classes in Java. Declared after every typemap they use: C-mode SWIG
 * keys class typemaps on the struct tag, and %extend bodies join the struct's node. */
typedef struct akv_context {} akv_context;
typedef struct akv_cache {} akv_cache;

%extend akv_context {
  /** A context: backend, CUDA device ordinal, CPU threads (0 = all, at most 1024). */
  akv_context(akv_backend backend, int32_t device, int32_t num_threads) {
    akv_context_options options;
    akv_context *context = NULL;
    akv_context_options_init(&options);
    options.backend = backend;
    options.device = device;
    options.num_threads = num_threads;
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

  /** Compress one layer from host buffers: keys, values [H][S][D]; queries [Hq][W][D] or null. */
  akv_cache *compress(const akv_shape *shape, akv_dtype dtype, void *keys, size_t keys_bytes,
                      void *values, size_t values_bytes, void *queries, size_t queries_bytes,
                      const akv_compress_options *options) {
    akv_prefill prefill;
    akv_cache *cache = NULL;
    const size_t kv = (size_t)shape->num_kv_heads * (size_t)shape->seq_len * (size_t)shape->head_dim;
    const size_t window = options ? (size_t)options->window : 32;
    if (!akv_java_fits("keys", keys_bytes, kv, dtype) || !akv_java_fits("values", values_bytes, kv, dtype))
      return NULL;
    if (queries && !akv_java_fits("queries", queries_bytes,
                                  (size_t)shape->num_q_heads * window * (size_t)shape->head_dim, dtype))
      return NULL;
    akv_prefill_init(&prefill);
    prefill.shape = *shape;
    prefill.dtype = dtype;
    prefill.keys = keys;
    prefill.values = values;
    prefill.queries = queries;
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
    akv_java_ok(akv_compress($self, &prefill, options, &cache, (void *)(intptr_t)stream));
    return cache;
  }

  /** A cache from serialized bytes. */
  akv_cache *deserialize(void *bytes, size_t size) {
    akv_cache *cache = NULL;
    akv_java_ok(akv_cache_deserialize($self, bytes, size, &cache, NULL));
    return cache;
  }
}

%extend akv_cache {
  ~akv_cache() { akv_cache_destroy($self); }

  void reserve_tokens(int64_t tokens) { akv_java_ok(akv_cache_reserve($self, tokens, NULL)); }

  /** Append num_tokens exact tokens: keys, values [H][num_tokens][D]. */
  void append(void *keys, size_t keys_bytes, void *values, size_t values_bytes, akv_dtype dtype,
              int32_t num_tokens) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t count = (size_t)stats.shape.num_kv_heads * (size_t)(num_tokens > 0 ? num_tokens : 0) *
                         (size_t)stats.shape.head_dim;
    if (akv_java_fits("keys", keys_bytes, count, dtype) && akv_java_fits("values", values_bytes, count, dtype))
      akv_java_ok(akv_append($self, keys, values, dtype, num_tokens, NULL, NULL));
  }

  /** Attention of q_len new queries over the cache: queries, out [Hq][q_len][D]. */
  void decode(void *queries, size_t queries_bytes, akv_dtype dtype, int32_t q_len, void *out,
              size_t out_bytes) {
    akv_cache_stats stats;
    if (!akv_java_shape($self, &stats)) return;
    const size_t count = (size_t)stats.shape.num_q_heads * (size_t)(q_len > 0 ? q_len : 0) *
                         (size_t)stats.shape.head_dim;
    if (akv_java_fits("queries", queries_bytes, count, dtype) && akv_java_fits("out", out_bytes, count, dtype))
      akv_java_ok(akv_decode($self, queries, dtype, q_len, out, NULL));
  }

  /** decode with device addresses (CUDA context) on `stream` (0 = default). */
  void decodeDevice(int64_t queries, akv_dtype dtype, int32_t q_len, int64_t out, int64_t stream) {
    akv_java_ok(akv_decode($self, (const void *)(intptr_t)queries, dtype, q_len, (void *)(intptr_t)out,
                           (void *)(intptr_t)stream));
  }

  /** Byte accounting and counts (a new CacheStats). */
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
  /** The library's defaults (akv_compress_options_init). */
  akv_compress_options() {
    akv_compress_options *options = calloc(1, sizeof *options);
    if (options) akv_compress_options_init(options);
    return options;
  }
  /** The paper's setup of `method` (akv_compress_options_init_method). */
  akv_compress_options(akv_method method) {
    akv_compress_options *options = calloc(1, sizeof *options);
    if (options) akv_compress_options_init_method(options, method);
    return options;
  }
}

%extend akv_shape {
  akv_shape(int64_t seq_len, int32_t num_kv_heads, int32_t num_q_heads, int32_t head_dim) {
    akv_shape *shape = calloc(1, sizeof *shape);
    if (shape) {
      shape->seq_len = seq_len;
      shape->num_kv_heads = num_kv_heads;
      shape->num_q_heads = num_q_heads;
      shape->head_dim = head_dim;
    }
    return shape;
  }
}

%inline %{
/* Exact bytes a compressed cache of this shape will hold (akv_compressed_size). */
int64_t akv_compressed_bytes(const akv_compress_options *options, const akv_shape *shape) {
  size_t bytes = 0;
  akv_java_ok(akv_compressed_size(options, shape, &bytes));
  return (int64_t)bytes;
}
%}

%include <anchorkv/anchorkv.h>

%clear (void *keys, size_t keys_bytes), (void *values, size_t values_bytes),
       (void *queries, size_t queries_bytes), (void *out, size_t out_bytes), (void *bytes, size_t size),
       (void *buffer, size_t buffer_bytes);
%clear akv_cache *cache;
%clear akv_context *context;
