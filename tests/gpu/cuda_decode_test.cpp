// The CUDA backend against the CPU reference, on a device (skip without one): caches built
// on the CPU are serialized and deserialized into a CUDA context; appends go to both; the
// GPU decode of a batch with mixed lengths must match the CPU decode within the output
// dtype's rounding. Outputs are poisoned (NaN) before every run. Also: CUDA-graph capture
// and replay across appends, compression with device inputs, reconstruct, serialization
// round trips, and bad input that leaves the context usable.
#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "api/api_test_util.hpp"
#include "common/anchor_compare.hpp"

namespace {

using namespace akv_test;

void cuda_ok(cudaError_t err, const char *what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// Without a usable device the GPU tests skip; where one must be there (ANCHORKV_REQUIRE_GPU,
// set by scripts/device-check.sh on a GPU machine) they fail instead, so that a broken setup
// cannot pass as skipped.
#define AKV_SKIP_WITHOUT_GPU(why)                                          \
  do {                                                                     \
    if (std::getenv("ANCHORKV_REQUIRE_GPU")) FAIL() << "no GPU: " << why;  \
    GTEST_SKIP() << why;                                                   \
  } while (0)

// Device memory holding a copy of host bytes.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) { cuda_ok(cudaMalloc(&ptr_, std::max<size_t>(bytes, 1)), "cudaMalloc"); }
  explicit DeviceBuffer(const std::vector<uint8_t> &host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer &) = delete;
  DeviceBuffer &operator=(const DeviceBuffer &) = delete;
  void upload(const std::vector<uint8_t> &host) {
    cuda_ok(cudaMemcpy(ptr_, host.data(), host.size(), cudaMemcpyHostToDevice), "cudaMemcpy H2D");
  }
  void poison() { cuda_ok(cudaMemset(ptr_, 0xFF, bytes_), "cudaMemset"); }  // NaN in f32, f16 and bf16
  std::vector<uint8_t> download() const {
    std::vector<uint8_t> host(bytes_);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_ok(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
    return host;
  }
  void *get() const { return ptr_; }

 private:
  void *ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A CUDA stream for the test's lifetime.
class Stream {
 public:
  Stream() { cuda_ok(cudaStreamCreate(&stream_), "cudaStreamCreate"); }
  ~Stream() { cudaStreamDestroy(stream_); }
  Stream(const Stream &) = delete;
  Stream &operator=(const Stream &) = delete;
  operator cudaStream_t() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

// What `body` enqueues on `stream`, captured (global mode) and instantiated; body records
// the statuses of its calls for the test to check after the capture has ended.
class CapturedGraph {
 public:
  template <class Body>
  CapturedGraph(cudaStream_t stream, Body body) {
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "begin capture");
    body();
    cuda_ok(cudaStreamEndCapture(stream, &graph_), "end capture");
    cuda_ok(cudaGraphInstantiate(&exec_, graph_, 0), "instantiate");
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph &) = delete;
  CapturedGraph &operator=(const CapturedGraph &) = delete;
  void launch(cudaStream_t stream) const { cuda_ok(cudaGraphLaunch(exec_, stream), "graph launch"); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// A prefill's tensors copied to the device (keys from `key_bytes`, by default the prefill's
// own), and the akv_prefill that points at them.
struct DevicePrefill {
  DeviceBuffer keys, values, queries;
  akv_prefill view;
  explicit DevicePrefill(const PrefillData &data) : DevicePrefill(data, data.keys.bytes) {}
  DevicePrefill(const PrefillData &data, const std::vector<uint8_t> &key_bytes)
      : keys(key_bytes), values(data.values.bytes), queries(data.queries.bytes), view(data.view()) {
    view.keys = keys.get();
    view.values = values.get();
    view.queries = queries.get();
  }
};

struct DecodeCase {
  akv_method method;
  int64_t seq_len;
  int head_dim, group, q_len;
  akv_dtype dtype;
  int anchors = 0;  // AnchorKV: k per head (0: automatic)
  int storage_format = 0;  // AnchorKV: 2 or 3 for every request (0: request 1 in format 2, the others in 3)
  akv_rope_style rope = AKV_ROPE_NEOX;  // AKV_ROPE_NONE: keys handed rotated (docs/design.md §4.6)
};

std::string describe(const DecodeCase &c) {
  return "method " + std::to_string(c.method) + " S=" + std::to_string(c.seq_len) + " D=" + std::to_string(c.head_dim) +
         " G=" + std::to_string(c.group) + " q_len=" + std::to_string(c.q_len) + " dtype " + dtype_name(c.dtype) +
         (c.anchors ? " k=" + std::to_string(c.anchors) : "") +
         (c.storage_format ? " format " + std::to_string(c.storage_format) : "") +
         (c.rope == AKV_ROPE_NONE ? " no RoPE" : "");
}

// Tolerance of a GPU output against the CPU one in the output dtype.
// bf16: the split kernel runs the keys' side in bf16 for bf16 queries (decode_kernels.cuh,
// steps 2 and 5): logits off by a few 2^-9 of their size, up to ~0.03 on a peaked output in
// the emulation and now and then an element of a near-tied row further (tests/emu, the same
// bounds: decode_output_near).
double tolerance(akv_dtype dtype) { return dtype == AKV_DTYPE_F32 ? 2e-3 : dtype == AKV_DTYPE_F16 ? 4e-3 : 4e-2; }

// Tolerance of one request's akv_decode against its row of akv_decode_batch: one unit in the
// last place of the output dtype (relative, and absolute near zero). The two are not bit-equal
// on hardware: the plan (splits) depends on the batch, so the fp32 partial sums are
// added in another order, and the shared-memory atomics that gather the per-anchor weights
// run in an order the hardware chooses. Making them bit-equal would cost a batch-independent
// plan and a fixed-order reduction of the weights; a fp32 reordering moves an output by far
// less than the bf16/f16 rounding step, so one step is the honest bound (f32: 1e-5).
double batch_row_tolerance(akv_dtype dtype) {
  return dtype == AKV_DTYPE_F32 ? 1e-5 : dtype == AKV_DTYPE_F16 ? 0x1p-10 : 0x1p-7;
}

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    akv_context_options o;
    akv_context_options_init(&o);
    o.backend = AKV_BACKEND_CUDA;
    akv_context *ctx = nullptr;
    const akv_status s = akv_context_create(&o, &ctx);
    if (s == AKV_ERR_BACKEND_UNAVAILABLE) AKV_SKIP_WITHOUT_GPU(akv_last_error_message());
    ASSERT_EQ(s, AKV_OK) << akv_last_error_message();
    gpu_.reset(ctx);
    cpu_ = make_context();
  }
  CachePtr to_gpu(const akv_cache *cache) { return deserialize(gpu_.get(), serialize(cache)); }
  // akv_compress on the CUDA context from device copies of the prefill.
  CachePtr compress_on_gpu(const PrefillData &data, const akv_compress_options &o) {
    const DevicePrefill device(data);
    akv_cache *raw = nullptr;
    ok(akv_compress(gpu_.get(), &device.view, &o, &raw, nullptr), "akv_compress on CUDA");
    return CachePtr(raw);
  }
  // `batch` requests of mixed lengths (H = kHeads) compressed on the CPU and moved to the GPU,
  // with the same kAppended tokens appended on both backends.
  struct Requests {
    std::vector<CachePtr> cpu_caches, gpu_caches;
    std::vector<akv_cache *> cpu, gpu;
  };
  static constexpr int kHeads = 2, kAppended = 5;
  Requests make_requests(const DecodeCase &c, int batch, Rng &rng);
  void check_decode(const DecodeCase &c, int batch, Rng &rng);
  void check_one_format(int format);  // every request in storage format 2 or 3, f32 and bf16
  void check_compression(int64_t S, int D, int G, akv_dtype dtype, Rng &rng);
  ContextPtr gpu_, cpu_;
};

Cuda::Requests Cuda::make_requests(const DecodeCase &c, int batch, Rng &rng) {
  const int H = kHeads, appended = kAppended;
  Requests r;
  for (int b = 0; b < batch; ++b) {
    akv_compress_options o;
    akv_compress_options_init_method(&o, c.method);
    o.rope.style = c.rope;
    PrefillSpec spec;
    spec.seq_len = c.seq_len - 331 * b;  // mixed lengths
    spec.kv_heads = H;
    spec.group = c.group;
    spec.head_dim = c.head_dim;
    spec.window = o.window;
    // Gapped positions: format 2 (request 1 unless the case names one format), else format 3.
    spec.explicit_positions = c.storage_format == 2 || (c.storage_format == 0 && b == 1);
    if (spec.explicit_positions) o.storage_format = 2;
    const PrefillData data = make_prefill(rng, spec);
    if (c.method == AKV_METHOD_ANCHORKV) {
      o.anchors = c.anchors;
      o.retain_fraction = std::max(0.05, workable_retain_fraction(data.shape, o.window, c.anchors, 0.02));
    } else if (c.method != AKV_METHOD_FULLKV) {
      o.retain_fraction = 0.2;
    }
    r.cpu_caches.push_back(compress(cpu_.get(), data, o));
    r.gpu_caches.push_back(to_gpu(r.cpu_caches.back().get()));
    // The same appended tokens on both backends (device tensors for the GPU cache).
    const Tensor k = make_tensor(nonzero_normal(rng, static_cast<size_t>(H) * appended * c.head_dim), c.dtype);
    const Tensor v = make_tensor(nonzero_normal(rng, static_cast<size_t>(H) * appended * c.head_dim), c.dtype);
    ok(akv_append(r.cpu_caches.back().get(), k.data(), v.data(), c.dtype, appended, nullptr, nullptr), "akv_append cpu");
    DeviceBuffer dk(k.bytes), dv(v.bytes);
    ok(akv_append(r.gpu_caches.back().get(), dk.get(), dv.get(), c.dtype, appended, nullptr, nullptr), "akv_append gpu");
    cuda_ok(cudaDeviceSynchronize(), "append");
    r.cpu.push_back(r.cpu_caches.back().get());
    r.gpu.push_back(r.gpu_caches.back().get());
  }
  return r;
}

// The GPU's akv_decode_batch against the CPU's over make_requests(), and one request's
// akv_decode against its row of the batch.
void Cuda::check_decode(const DecodeCase &c, int batch, Rng &rng) {
  SCOPED_TRACE(describe(c));
  const Requests requests = make_requests(c, batch, rng);
  const std::vector<akv_cache *> &cpu_list = requests.cpu, &gpu_list = requests.gpu;
  const Tensor q = make_tensor(
      nonzero_normal(rng, static_cast<size_t>(batch) * kHeads * c.group * c.q_len * c.head_dim, 1.5), c.dtype);
  std::vector<uint8_t> expected_bytes = poisoned(q.count(), c.dtype);
  ok(akv_decode_batch(cpu_.get(), cpu_list.data(), batch, q.data(), c.dtype, c.q_len, expected_bytes.data(), nullptr),
     "cpu decode");
  DeviceBuffer dq(q.bytes), dout(q.bytes.size());
  dout.poison();
  ok(akv_decode_batch(gpu_.get(), gpu_list.data(), batch, dq.get(), c.dtype, c.q_len, dout.get(), nullptr), "gpu decode");
  const std::vector<float> got = decode_bytes(dout.download(), c.dtype);
  const std::vector<float> expected = decode_bytes(expected_bytes, c.dtype);
  EXPECT_EQ(count_non_finite(got), 0u);
  EXPECT_TRUE(decode_output_near(got, expected, c.dtype, tolerance(c.dtype)));  // bf16: rounding's rare outliers
  std::string key = "max_abs_error " + describe(c);  // a property name: letters, digits, '_'
  std::replace_if(key.begin(), key.end(), [](char ch) { return !std::isalnum(static_cast<unsigned char>(ch)); }, '_');
  note(key, max_error(got, expected, 1.0));
  // The last request through akv_decode against its row of the batch.
  const size_t row_bytes = q.bytes.size() / batch, row0 = (batch - 1) * row_bytes;
  DeviceBuffer one(row_bytes);
  one.poison();
  ok(akv_decode(gpu_list.back(), static_cast<const uint8_t *>(dq.get()) + row0, c.dtype, c.q_len, one.get(), nullptr),
     "gpu akv_decode");
  const std::vector<uint8_t> all = dout.download();
  const std::vector<float> single = decode_bytes(one.download(), c.dtype);
  const std::vector<float> row = decode_bytes(std::vector<uint8_t>(all.begin() + row0, all.end()), c.dtype);
  EXPECT_TRUE(all_near(single, row, batch_row_tolerance(c.dtype), batch_row_tolerance(c.dtype)));
}

// The GPU compression pass against the CPU compression of the same inputs, storage format 2
// (the paper preset) and 3 (the defaults): the caches agree section by section up to counted
// near-ties, and the decode outputs of the two caches.
void Cuda::check_compression(int64_t S, int D, int G, akv_dtype dtype, Rng &rng) {
  SCOPED_TRACE("S=" + std::to_string(S) + " D=" + std::to_string(D) + " G=" + std::to_string(G) + " " + dtype_name(dtype));
  for (int format : {2, 3}) {
    // Format 3 with bf16 keys given post-RoPE: the window scores' GEMM on bf16 operands.
    const bool post_rope = format == 3 && dtype == AKV_DTYPE_BF16;
    SCOPED_TRACE("storage format " + std::to_string(format) + (post_rope ? ", post-RoPE keys" : ""));
    PrefillSpec spec;
    spec.seq_len = S;
    spec.kv_heads = 2;
    spec.group = G;
    spec.head_dim = D;
    spec.dtype = dtype;
    akv_compress_options o = anchorkv_options(0.05);
    if (format == 3) akv_compress_options_init(&o);  // the defaults: coverage rounds, format 3
    o.keys_post_rope = post_rope ? 1 : 0;
    const RopeReference ref = rope_reference(o.rope);
    const PrefillData data = make_prefill(rng, spec, post_rope ? &ref : nullptr);
    o.retain_fraction = std::max(0.05, workable_retain_fraction(data.shape, 32, 0, 0.02));
    o.storage_format = format;
    CachePtr cpu_cache = compress(cpu_.get(), data, o);
    CachePtr gpu_cache = compress_on_gpu(data, o);
    CachePtr back = deserialize(cpu_.get(), serialize(gpu_cache.get()));
    EXPECT_TRUE(anchor_caches_agree(*back, *cpu_cache));
    const Tensor q = make_tensor(nonzero_normal(rng, static_cast<size_t>(2) * G * D, 1.5), AKV_DTYPE_F32);
    const bool same_anchors = compare_anchor_caches(*back, *cpu_cache).anchor_diff == 0;
    const double tol = same_anchors ? 2e-2 : 5e-2;  // as the emulation tests
    EXPECT_TRUE(all_near(decode(back.get(), q, 1), decode(cpu_cache.get(), q, 1), tol, tol));
  }
}

// The first thing a device run checks (scripts/device-check.sh): one decode and one
// compression against the CPU, in seconds.
TEST_F(Cuda, SmokeDecodeAndCompressionMatchCpu) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  check_decode({AKV_METHOD_ANCHORKV, 4096, 128, 4, 1, AKV_DTYPE_BF16}, 2, rng);
  check_compression(4096, 128, 4, AKV_DTYPE_BF16, rng);
}

// Every request of the batch in one storage format (make_requests otherwise mixes them), f32
// (the general path) and bf16 queries (format 3: the register-gather path). Also what
// device-check.sh runs compute-sanitizer's racecheck over one format at a time: the first
// device run's racecheck reported shared-memory hazards in the split kernel between accesses
// that a __syncthreads separates, which no reading of the source or SASS explains; format 3's
// metadata (format3_meta) holds the kernel's one named barrier (bar.sync 1, 64: warps 0-1), so
// hazards in format 3 only would point at how the tool counts that barrier.
void Cuda::check_one_format(int format) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  for (akv_dtype dtype : {AKV_DTYPE_F32, AKV_DTYPE_BF16})
    check_decode({AKV_METHOD_ANCHORKV, 4096, 128, 4, 1, dtype, 0, format}, 2, rng);
  // Keys handed rotated (no RoPE): bf16 queries on the register-gather path with the anchors'
  // scores looked up (decode_scores_kernel), 300 anchors: segment tables.
  if (format == 3) check_decode({AKV_METHOD_ANCHORKV, 4096, 128, 4, 2, AKV_DTYPE_BF16, 300, 3, AKV_ROPE_NONE}, 2, rng);
}
TEST_F(Cuda, FormatTwoDecodeMatchesCpu) { check_one_format(2); }
TEST_F(Cuda, FormatThreeDecodeMatchesCpu) { check_one_format(3); }

// ANCHORKV_DECODE_PROFILE (bench_decode.py --profile): the decode still matches the CPU, and
// each launch prints its kernels' times.
TEST_F(Cuda, ProfiledDecodeMatchesCpuAndPrintsItsKernels) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  struct Profiling {  // set for this test only, whatever it ends with
    Profiling() { setenv("ANCHORKV_DECODE_PROFILE", "1", 1); }
    ~Profiling() { unsetenv("ANCHORKV_DECODE_PROFILE"); }
  } profiling;
  testing::internal::CaptureStderr();
  check_decode({AKV_METHOD_ANCHORKV, 4096, 128, 4, 1, AKV_DTYPE_BF16}, 2, rng);
  const std::string err = testing::internal::GetCapturedStderr();
  // The batch, then its last request alone (format 2 in make_requests: not the fast path).
  EXPECT_NE(err.find("anchorkv decode profile D=128 rows=4 fast=0 requests=2: split "), std::string::npos) << err;
  EXPECT_NE(err.find("anchorkv decode profile D=128 rows=4 fast=0 requests=1: split "), std::string::npos) << err;
  EXPECT_NE(err.find(" blocks); merge "), std::string::npos) << err;
}

TEST_F(Cuda, DecodeMatchesCpuOverShapesMethodsAndMixedBatches) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const std::vector<DecodeCase> cases = {
      {AKV_METHOD_ANCHORKV, 1024, 64, 1, 1, AKV_DTYPE_F32},   {AKV_METHOD_ANCHORKV, 4096, 128, 4, 1, AKV_DTYPE_BF16},
      {AKV_METHOD_ANCHORKV, 4096, 64, 8, 4, AKV_DTYPE_F16},   {AKV_METHOD_ANCHORKV, 32768, 128, 4, 1, AKV_DTYPE_BF16},
      {AKV_METHOD_ANCHORKV, 3000, 128, 8, 4, AKV_DTYPE_F32},  {AKV_METHOD_ANCHORKV, 2048, 256, 2, 2, AKV_DTYPE_BF16},
      {AKV_METHOD_FULLKV, 4096, 128, 4, 1, AKV_DTYPE_BF16},   {AKV_METHOD_FULLKV, 1500, 64, 8, 4, AKV_DTYPE_F32},
      {AKV_METHOD_SNAPKV, 4096, 128, 4, 1, AKV_DTYPE_BF16},   {AKV_METHOD_ADAKV, 4096, 128, 4, 4, AKV_DTYPE_F32},
      {AKV_METHOD_ANDPRO, 4096, 64, 1, 1, AKV_DTYPE_BF16},
  };
  // ANCHORKV_TEST_QUICK (compute-sanitizer runs): the cases up to 4K tokens only.
  const bool quick = std::getenv("ANCHORKV_TEST_QUICK") != nullptr;
  for (const DecodeCase &c : cases)
    if (!quick || c.seq_len <= 4096) check_decode(c, 3, rng);
}

// Long contexts: 64K and 128K tokens, q_len 1 and 4, G 1, 4 and 8; at 128K, k = 1024 anchors
// of D = 128 (256 KB of bf16 keys, more than a block's shared memory: the key tiles read the
// anchor rows through L2), and k = 4096, whose weights in shared memory would leave one block
// a multiprocessor: the plan sums them a segment table at a time (DecodePlan::Weights::
// kSegments). ANCHORKV_TEST_QUICK (compute-sanitizer runs): the first case only.
TEST_F(Cuda, DecodeLongContextsMatchCpu) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const std::vector<DecodeCase> cases = {
      {AKV_METHOD_ANCHORKV, 131072, 128, 8, 4, AKV_DTYPE_BF16, 1024},
      {AKV_METHOD_ANCHORKV, 131072, 128, 4, 1, AKV_DTYPE_BF16, 1024},
      {AKV_METHOD_ANCHORKV, 131072, 128, 1, 4, AKV_DTYPE_F32, 1024},
      {AKV_METHOD_ANCHORKV, 32768, 128, 1, 1, AKV_DTYPE_BF16, 256},
      {AKV_METHOD_ANCHORKV, 65536, 128, 8, 1, AKV_DTYPE_F16, 512},
      {AKV_METHOD_ANCHORKV, 65536, 128, 4, 4, AKV_DTYPE_BF16, 512},
      {AKV_METHOD_ANCHORKV, 131072, 128, 4, 1, AKV_DTYPE_BF16, 4096},
  };
  const bool quick = std::getenv("ANCHORKV_TEST_QUICK") != nullptr;
  for (const DecodeCase &c : cases) {
    check_decode(c, 2, rng);
    if (quick) break;
  }
}

// A decode captured in a CUDA graph replays with no allocation and sees tokens appended
// after the capture (the length is read on the device).
TEST_F(Cuda, GraphCapturedDecodeReplaysAcrossAppends) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 5000;
  spec.kv_heads = 2;
  spec.group = 4;
  spec.head_dim = 128;
  const PrefillData data = make_prefill(rng, spec);
  CachePtr cpu_cache = compress(cpu_.get(), data, anchorkv_options(0.05));
  CachePtr gpu_cache = to_gpu(cpu_cache.get());
  ok(akv_cache_reserve(gpu_cache.get(), 64, nullptr), "reserve");
  const size_t n = 2 * 4 * 128;
  const Tensor q = make_tensor(nonzero_normal(rng, n, 1.5), AKV_DTYPE_F32);
  DeviceBuffer dq(q.bytes), dout(q.bytes.size());
  const Stream stream;
  akv_cache *list[1] = {gpu_cache.get()};
  // Warm-up on the stream sizes its workspace; then capture.
  ok(akv_decode_batch(gpu_.get(), list, 1, dq.get(), AKV_DTYPE_F32, 1, dout.get(), stream), "warm-up decode");
  akv_status captured = AKV_OK;
  const CapturedGraph graph(stream, [&] {
    captured = akv_decode_batch(gpu_.get(), list, 1, dq.get(), AKV_DTYPE_F32, 1, dout.get(), stream);
  });
  ASSERT_EQ(captured, AKV_OK) << akv_last_error_message();
  for (int step = 0; step < 3; ++step) {
    if (step > 0) {  // one more token on both backends, outside the graph
      const std::vector<float> k = nonzero_normal(rng, 2 * 128), v = nonzero_normal(rng, 2 * 128);
      ok(akv_append(cpu_cache.get(), k.data(), v.data(), AKV_DTYPE_F32, 1, nullptr, nullptr), "append cpu");
      DeviceBuffer dk(encode(k, AKV_DTYPE_F32)), dv(encode(v, AKV_DTYPE_F32));
      ok(akv_append(gpu_cache.get(), dk.get(), dv.get(), AKV_DTYPE_F32, 1, nullptr, stream), "append gpu");
      cuda_ok(cudaStreamSynchronize(stream), "sync");
    }
    dout.poison();
    graph.launch(stream);
    cuda_ok(cudaStreamSynchronize(stream), "sync");
    const std::vector<float> got = decode_bytes(dout.download(), AKV_DTYPE_F32);
    const std::vector<float> expected = decode(cpu_cache.get(), q, 1);
    EXPECT_TRUE(all_near(got, expected, 2e-3, 2e-3)) << "replay " << step;
  }
}

// A graph captured on one stream and replayed on another while the capture stream runs
// decodes of another cache: each has its own scratch (the captured decode allocates inside
// the graph), so both results stay right.
TEST_F(Cuda, GraphReplayedOnAnotherStreamHasItsOwnWorkspace) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 20000;
  spec.kv_heads = 2;
  spec.group = 4;
  spec.head_dim = 128;
  const PrefillData a_data = make_prefill(rng, spec), b_data = make_prefill(rng, spec);
  CachePtr a_cpu = compress(cpu_.get(), a_data, anchorkv_options(0.05));
  CachePtr b_cpu = compress(cpu_.get(), b_data, anchorkv_options(0.05));
  CachePtr a_gpu = to_gpu(a_cpu.get()), b_gpu = to_gpu(b_cpu.get());
  const size_t n = 2 * 4 * 128;
  const Tensor qa = make_tensor(nonzero_normal(rng, n, 1.5), AKV_DTYPE_F32);
  const Tensor qb = make_tensor(nonzero_normal(rng, n, 1.5), AKV_DTYPE_F32);
  DeviceBuffer dqa(qa.bytes), dqb(qb.bytes), outa(qa.bytes.size()), outb(qb.bytes.size());
  const Stream capture_stream, replay_stream;
  akv_cache *la[1] = {a_gpu.get()}, *lb[1] = {b_gpu.get()};
  ok(akv_decode_batch(gpu_.get(), la, 1, dqa.get(), AKV_DTYPE_F32, 1, outa.get(), capture_stream), "warm-up");
  akv_status captured = AKV_OK;
  const CapturedGraph graph(capture_stream, [&] {
    captured = akv_decode_batch(gpu_.get(), la, 1, dqa.get(), AKV_DTYPE_F32, 1, outa.get(), capture_stream);
  });
  ASSERT_EQ(captured, AKV_OK) << akv_last_error_message();
  const std::vector<float> want_a = decode(a_cpu.get(), qa, 1), want_b = decode(b_cpu.get(), qb, 1);
  for (int round = 0; round < 5; ++round) {
    outa.poison();
    outb.poison();
    cuda_ok(cudaDeviceSynchronize(), "sync");
    graph.launch(replay_stream);
    ok(akv_decode_batch(gpu_.get(), lb, 1, dqb.get(), AKV_DTYPE_F32, 1, outb.get(), capture_stream), "concurrent decode");
    cuda_ok(cudaDeviceSynchronize(), "sync");
    EXPECT_TRUE(all_near(decode_bytes(outa.download(), AKV_DTYPE_F32), want_a, 2e-3, 2e-3)) << "replay, round " << round;
    EXPECT_TRUE(all_near(decode_bytes(outb.download(), AKV_DTYPE_F32), want_b, 2e-3, 2e-3)) << "decode, round " << round;
  }
}

// An append captured in a CUDA graph together with the decode (an engine's whole decode
// step): every replay appends the token the engine wrote into the same device buffers at the
// next position (read on the device, not baked into the graph), the decode sees it, and the
// host's record (stats, positions) catches up at the next call that reads it. Explicit
// positions are refused under capture. Replays past the reservation drop tokens and the next
// call that reads the record says so (AKV_ERR_CAPACITY), the cache staying usable.
TEST_F(Cuda, GraphCapturedAppendAdvancesOnEveryReplay) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 3000;
  spec.kv_heads = 2;
  spec.group = 4;
  spec.head_dim = 128;
  const PrefillData data = make_prefill(rng, spec);
  for (int capacity : {16, 2}) {
    SCOPED_TRACE("capacity " + std::to_string(capacity));
    CachePtr cpu_cache = compress(cpu_.get(), data, anchorkv_options(0.05));
    CachePtr gpu_cache = to_gpu(cpu_cache.get());
    ok(akv_cache_reserve(gpu_cache.get(), capacity, nullptr), "reserve");
    const size_t n = 2 * 4 * 128, kv = 2 * 128;
    const Tensor q = make_tensor(nonzero_normal(rng, n, 1.5), AKV_DTYPE_F32);
    DeviceBuffer dq(q.bytes), dout(q.bytes.size()), dk(kv * 4), dv(kv * 4);
    const Stream stream;
    akv_cache *list[1] = {gpu_cache.get()};
    ok(akv_decode_batch(gpu_.get(), list, 1, dq.get(), AKV_DTYPE_F32, 1, dout.get(), stream), "warm-up decode");
    const int32_t explicit_position = 100000;
    akv_status refused = AKV_OK, appended = AKV_OK, decoded = AKV_OK;
    const CapturedGraph graph(stream, [&] {
      refused = akv_append(gpu_cache.get(), dk.get(), dv.get(), AKV_DTYPE_F32, 1, &explicit_position, stream);
      appended = akv_append(gpu_cache.get(), dk.get(), dv.get(), AKV_DTYPE_F32, 1, nullptr, stream);
      decoded = akv_decode_batch(gpu_.get(), list, 1, dq.get(), AKV_DTYPE_F32, 1, dout.get(), stream);
    });
    EXPECT_EQ(refused, AKV_ERR_INVALID_ARGUMENT) << "explicit positions under capture";
    ASSERT_EQ(appended, AKV_OK) << akv_last_error_message();
    ASSERT_EQ(decoded, AKV_OK) << akv_last_error_message();
    const int replays = 3;
    for (int step = 0; step < replays; ++step) {
      const std::vector<float> k = nonzero_normal(rng, kv), v = nonzero_normal(rng, kv);
      dk.upload(encode(k, AKV_DTYPE_F32));
      dv.upload(encode(v, AKV_DTYPE_F32));
      if (step < capacity) ok(akv_append(cpu_cache.get(), k.data(), v.data(), AKV_DTYPE_F32, 1, nullptr, nullptr), "append cpu");
      dout.poison();
      graph.launch(stream);
      cuda_ok(cudaStreamSynchronize(stream), "sync");
      if (step >= capacity) continue;  // dropped on the device: the CPU cache did not take it
      const std::vector<float> got = decode_bytes(dout.download(), AKV_DTYPE_F32);
      EXPECT_TRUE(all_near(got, decode(cpu_cache.get(), q, 1), 2e-3, 2e-3)) << "replay " << step;
    }
    akv_cache_stats stats;
    stats.struct_size = sizeof stats;
    const akv_status first = akv_cache_stats_get(gpu_cache.get(), &stats);
    if (capacity >= replays) {
      ASSERT_EQ(first, AKV_OK) << akv_last_error_message();
    } else {
      EXPECT_EQ(first, AKV_ERR_CAPACITY) << "tokens dropped past the reservation must be reported";
      ok(akv_cache_stats_get(gpu_cache.get(), &stats), "stats after the report");
    }
    EXPECT_EQ(stats.appended_tokens, std::min(capacity, replays));
    // The positions came back too: the reconstructed caches agree token for token.
    EXPECT_TRUE(all_near(reconstruct(gpu_cache.get(), 1).keys, reconstruct(cpu_cache.get(), 1).keys, 1e-2, 1e-2));
  }
}

// akv_cache_compact on a CUDA cache (staged through the host): the compacted cache agrees
// with the CPU's compaction of the same cache, and a graph-captured decode replays on it once
// re-captured (the buffers move).
TEST_F(Cuda, CompactionMatchesCpu) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  for (akv_method method : {AKV_METHOD_ANCHORKV, AKV_METHOD_SNAPKV}) {
    SCOPED_TRACE("method " + std::to_string(method));
    PrefillSpec spec;
    spec.seq_len = 2048;
    spec.kv_heads = 2;
    spec.group = 2;
    spec.head_dim = 64;
    akv_compress_options o;
    akv_compress_options_init_method(&o, method);
    o.retain_fraction = 0.2;
    o.window = 32;
    const PrefillData data = make_prefill(rng, spec);
    CachePtr cpu_cache = compress(cpu_.get(), data, o);
    CachePtr gpu_cache = to_gpu(cpu_cache.get());
    const int n = 300;
    const std::vector<float> k = nonzero_normal(rng, 2 * n * 64), v = nonzero_normal(rng, 2 * n * 64);
    ok(akv_append(cpu_cache.get(), k.data(), v.data(), AKV_DTYPE_F32, n, nullptr, nullptr), "append cpu");
    DeviceBuffer dk(encode(k, AKV_DTYPE_F32)), dv(encode(v, AKV_DTYPE_F32));
    ok(akv_append(gpu_cache.get(), dk.get(), dv.get(), AKV_DTYPE_F32, n, nullptr, nullptr), "append gpu");
    // Compact the CPU's copy of the GPU cache (the same appended rows) and the GPU cache.
    CachePtr expected = deserialize(cpu_.get(), serialize(gpu_cache.get()));
    const Tensor window = make_tensor(nonzero_normal(rng, 4 * 32 * 64, 1.5), AKV_DTYPE_F32);
    ok(akv_cache_compact(expected.get(), window.data(), AKV_DTYPE_F32, 64, nullptr), "compact cpu");
    DeviceBuffer dq(window.bytes);
    ok(akv_cache_compact(gpu_cache.get(), dq.get(), AKV_DTYPE_F32, 64, nullptr), "compact gpu");
    // The same CPU code on the same bytes (the staging context may run other thread counts).
    EXPECT_EQ(serialize(gpu_cache.get()).size(), serialize(expected.get()).size());
    EXPECT_EQ(cache_stats(gpu_cache.get()).compressed_bytes, cache_stats(expected.get()).compressed_bytes);
    EXPECT_EQ(cache_stats(gpu_cache.get()).compactions, 1);
    const Tensor q = make_tensor(nonzero_normal(rng, 4 * 64, 1.5), AKV_DTYPE_F32);
    DeviceBuffer dq1(q.bytes), dout(q.bytes.size());
    ok(akv_decode(gpu_cache.get(), dq1.get(), AKV_DTYPE_F32, 1, dout.get(), nullptr), "decode gpu");
    EXPECT_TRUE(all_near(decode_bytes(dout.download(), AKV_DTYPE_F32), decode(expected.get(), q, 1), 2e-3, 2e-3));
  }
}

// Compression with device inputs: the AnchorKV GPU pass agrees with the CPU compression
// section by section (near-ties counted and bounded, tests/common/anchor_compare.hpp) and
// its decode output closely; FullKV within one storage step of the CPU's keys; the eviction
// baselines keep the CPU's tokens up to near-tie swaps. Reconstruct and serialization of a CUDA cache agree with the CPU.
TEST_F(Cuda, CompressReconstructAndSerializeMatchCpu) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  // AnchorKV twice: storage formats 3 and 2, both compressed by the device pass.
  const std::pair<akv_method, int> runs[] = {{AKV_METHOD_ANCHORKV, 3}, {AKV_METHOD_ANCHORKV, 2}, {AKV_METHOD_SNAPKV, 0},
                                             {AKV_METHOD_FULLKV, 0},   {AKV_METHOD_ADAKV, 0},    {AKV_METHOD_ANDPRO, 0},
                                             {AKV_METHOD_PYRAMIDKV, 0}};
  for (const auto &[method, format] : runs) {
    SCOPED_TRACE("method " + std::to_string(method) + " storage format " + std::to_string(format));
    PrefillSpec spec;
    spec.seq_len = 3000;
    spec.kv_heads = 2;
    spec.group = 2;
    spec.head_dim = 64;
    spec.dtype = AKV_DTYPE_BF16;
    akv_compress_options o;
    akv_compress_options_init_method(&o, method);
    o.storage_format = format;
    if (method == AKV_METHOD_ANCHORKV) o.retain_fraction = 0.1;
    if (method != AKV_METHOD_ANCHORKV && method != AKV_METHOD_FULLKV) o.retain_fraction = 0.2;
    spec.window = o.window;
    const PrefillData data = make_prefill(rng, spec);
    CachePtr cpu_cache = compress(cpu_.get(), data, o);
    CachePtr gpu_cache = compress_on_gpu(data, o);
    if (method == AKV_METHOD_ANCHORKV) {
      CachePtr back = deserialize(cpu_.get(), serialize(gpu_cache.get()));
      EXPECT_TRUE(anchor_caches_agree(*back, *cpu_cache));
      // From here on compare against the GPU's own cache, decoded and rebuilt on the CPU.
      cpu_cache = std::move(back);
    } else if (method == AKV_METHOD_FULLKV) {  // on the device too
      CachePtr back = deserialize(cpu_.get(), serialize(gpu_cache.get()));
      EXPECT_TRUE(dense_caches_agree(*back, *cpu_cache));
      cpu_cache = std::move(back);
    } else {  // the eviction baselines on the device too
      CachePtr back = deserialize(cpu_.get(), serialize(gpu_cache.get()));
      EXPECT_TRUE(eviction_caches_agree(*back, *cpu_cache));
      cpu_cache = std::move(back);
    }
    const akv_cache_stats gs = cache_stats(gpu_cache.get()), cs = cache_stats(cpu_cache.get());
    EXPECT_EQ(gs.compressed_bytes, cs.compressed_bytes);
    EXPECT_EQ(gs.key_residuals, cs.key_residuals);
    const std::vector<akv_head_stats> gh = head_stats(gpu_cache.get(), 2), ch = head_stats(cpu_cache.get(), 2);
    for (int h = 0; h < 2; ++h) EXPECT_EQ(gh[h].value_residuals, ch[h].value_residuals);
    const Dense expected = reconstruct(cpu_cache.get(), 1);
    const size_t count = expected.keys.size() * sizeof(float);
    DeviceBuffer keys(count), values(count), present(expected.present.size());
    keys.poison();
    values.poison();
    ok(akv_cache_reconstruct(gpu_cache.get(), AKV_DTYPE_F32, 1, keys.get(), values.get(),
                             static_cast<uint8_t *>(present.get()), nullptr),
       "reconstruct on CUDA");
    EXPECT_EQ(decode_bytes(keys.download(), AKV_DTYPE_F32), expected.keys);
    EXPECT_EQ(decode_bytes(values.download(), AKV_DTYPE_F32), expected.values);
    EXPECT_EQ(present.download(), expected.present);
    // The logit penalties (format 3's logit_correction) read from device memory.
    EXPECT_EQ(logit_penalties(gpu_cache.get()), logit_penalties(cpu_cache.get()));
  }
}

// The GPU compression pass over S, D, G and dtypes (SPEC 2), against the CPU compression of
// the same inputs, and the decode outputs of the two caches.
TEST_F(Cuda, CompressionPassMatchesCpuOverShapes) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const bool quick = std::getenv("ANCHORKV_TEST_QUICK") != nullptr;
  struct Shape {
    int64_t S;
    int D, G;
    akv_dtype dtype;
  };
  for (const Shape &c : std::vector<Shape>{{1024, 64, 1, AKV_DTYPE_BF16}, {4096, 128, 4, AKV_DTYPE_F16},
                                           {4096, 64, 8, AKV_DTYPE_BF16}, {32768, 128, 4, AKV_DTYPE_BF16},
                                           {32768, 64, 1, AKV_DTYPE_F16}})
    if (!quick || c.S <= 4096) check_compression(c.S, c.D, c.G, c.dtype, rng);
}

TEST_F(Cuda, UnsupportedCachesAreRefusedAndTheContextStaysUsable) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  PrefillSpec spec;
  spec.seq_len = 600;
  spec.head_dim = 32;  // the CUDA kernels take 64, 128, 256
  const PrefillData small = make_prefill(rng, spec);
  CachePtr cache = compress(cpu_.get(), small, fullkv_options());
  const std::vector<uint8_t> bytes = serialize(cache.get());
  akv_cache *out = nullptr;
  EXPECT_EQ(akv_cache_deserialize(gpu_.get(), bytes.data(), bytes.size(), &out, nullptr), AKV_ERR_UNSUPPORTED);
  EXPECT_EQ(out, nullptr);
  EXPECT_TRUE(contains_case_insensitive(akv_last_error_message(), "head_dim"));
  spec.head_dim = 64;
  const PrefillData data = make_prefill(rng, spec);
  akv_compress_options q;
  akv_compress_options_init_method(&q, AKV_METHOD_QUANTIZED);
  CachePtr quantized = compress(cpu_.get(), data, q);
  const std::vector<uint8_t> qbytes = serialize(quantized.get());
  EXPECT_EQ(akv_cache_deserialize(gpu_.get(), qbytes.data(), qbytes.size(), &out, nullptr), AKV_ERR_UNSUPPORTED);
  EXPECT_EQ(out, nullptr);
  // NaN in device inputs: the compression pass reports it (it waits for its check).
  {
    std::vector<float> keys = decode_bytes(data.keys.bytes, data.keys.dtype);
    keys[keys.size() / 3] = std::nanf("");
    const DevicePrefill device(data, encode(keys, data.keys.dtype));
    const akv_compress_options o = anchorkv_options(0.3);
    EXPECT_EQ(akv_compress(gpu_.get(), &device.view, &o, &out, nullptr), AKV_ERR_NON_FINITE);
    EXPECT_EQ(out, nullptr);
  }
  // Corrupted bytes answer CORRUPT_DATA, and the context still works afterwards.
  std::vector<uint8_t> bad = serialize(compress(cpu_.get(), data, fullkv_options()).get());
  bad[bad.size() / 2] ^= 0x5A;
  EXPECT_EQ(akv_cache_deserialize(gpu_.get(), bad.data(), bad.size(), &out, nullptr), AKV_ERR_CORRUPT_DATA);
  CachePtr good = to_gpu(compress(cpu_.get(), data, fullkv_options()).get());
  const Tensor qt = make_tensor(nonzero_normal(rng, 2 * 64, 1.0), AKV_DTYPE_F32);
  DeviceBuffer dq(qt.bytes), dout(qt.bytes.size());
  EXPECT_EQ(akv_decode(good.get(), dq.get(), AKV_DTYPE_F32, 2, dout.get(), nullptr), AKV_ERR_INVALID_ARGUMENT);
  ok(akv_decode(good.get(), dq.get(), AKV_DTYPE_F32, 1, dout.get(), nullptr), "decode after errors");
}

// akv_decode_batch_lse / akv_decode_lse on the device: every row's log-sum-exp equals the
// CPU's (the output is akv_decode_batch's, checked above).
TEST_F(Cuda, DecodeLseMatchesCpu) {
  const uint64_t seed = fresh_seed();
  AKV_TRACE_SEED(seed);
  Rng rng(seed);
  const std::vector<DecodeCase> cases = {{AKV_METHOD_ANCHORKV, 2048, 64, 3, 1, AKV_DTYPE_BF16},
                                         {AKV_METHOD_ANCHORKV, 1500, 128, 4, 3, AKV_DTYPE_F32},
                                         {AKV_METHOD_FULLKV, 1200, 64, 3, 2, AKV_DTYPE_F16}};
  for (const DecodeCase &c : cases) {
    SCOPED_TRACE(describe(c));
    const int batch = 2;
    const Requests requests = make_requests(c, batch, rng);
    const std::vector<akv_cache *> &cpu_list = requests.cpu, &gpu_list = requests.gpu;
    const size_t rows = static_cast<size_t>(batch) * kHeads * c.group * c.q_len;
    const Tensor q = make_tensor(nonzero_normal(rng, rows * c.head_dim, 1.5), c.dtype);
    std::vector<uint8_t> cpu_out = poisoned(q.count(), c.dtype);
    std::vector<float> cpu_lse(rows);
    ok(akv_decode_batch_lse(cpu_.get(), cpu_list.data(), batch, q.data(), c.dtype, c.q_len, cpu_out.data(),
                            cpu_lse.data(), nullptr),
       "cpu decode lse");
    DeviceBuffer dq(q.bytes), dout(q.bytes.size()), dlse(rows * sizeof(float));
    dout.poison();
    dlse.poison();
    ok(akv_decode_batch_lse(gpu_.get(), gpu_list.data(), batch, dq.get(), c.dtype, c.q_len, dout.get(),
                            static_cast<float *>(dlse.get()), nullptr),
       "gpu decode lse");
    const std::vector<uint8_t> lse_bytes = dlse.download();
    std::vector<float> got(rows);
    std::memcpy(got.data(), lse_bytes.data(), lse_bytes.size());
    EXPECT_EQ(count_non_finite(got), 0u);
    // bf16 queries: the keys' side runs in bf16 (decode_kernels.cuh, steps 2 and 5), logits
    // off by a few 2^-9 of their size: a relative bound of about one bf16 unit (tests/emu).
    const bool bf16 = c.dtype == AKV_DTYPE_BF16;
    EXPECT_TRUE(all_near(got, cpu_lse, bf16 ? 1e-2 : 1e-3, bf16 ? 4e-3 : 1e-4)) << "log-sum-exp";
    note("lse_max_abs_error_" + std::to_string(&c - cases.data()), max_error(got, cpu_lse, 1.0));
    // The second request alone through akv_decode_lse: its rows of the batch.
    DeviceBuffer one(rows / batch * sizeof(float));
    one.poison();
    ok(akv_decode_lse(gpu_list[1], static_cast<const uint8_t *>(dq.get()) + q.bytes.size() / batch, c.dtype, c.q_len,
                      static_cast<uint8_t *>(dout.get()) + q.bytes.size() / batch, static_cast<float *>(one.get()),
                      nullptr),
       "gpu akv_decode_lse");
    // Not bit for bit: the plan splits a batch of two and one request differently, so the
    // splits' sums are added in another order (the first device run, H100, differed there).
    const std::vector<uint8_t> single_bytes = one.download();
    std::vector<float> single(single_bytes.size() / sizeof(float));
    std::memcpy(single.data(), single_bytes.data(), single_bytes.size());
    const auto n = static_cast<std::ptrdiff_t>(single.size());
    const std::vector<float> row(got.begin() + n, got.begin() + 2 * n);
    EXPECT_TRUE(all_near(single, row, 1e-5, 1e-5)) << "akv_decode_lse against its rows of the batch";
  }
}

}  // namespace

namespace {

// Allocator hooks run with the context's device current (a torch-style allocator places
// memory on the current device), and no call leaves the caller's current device switched. On
// a machine with two GPUs the context is on the last one while the caller's is the first.
TEST(CudaDevice, HooksSeeTheContextsDeviceAndTheCallersDeviceStays) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    AKV_SKIP_WITHOUT_GPU("no CUDA device");
  }
  struct Hooks {
    std::vector<int> seen;  // the current device in each hook call
    void record() {
      int d = -1;
      cuda_ok(cudaGetDevice(&d), "cudaGetDevice");
      seen.push_back(d);
    }
  } hooks;
  const int device = n - 1, caller = 0;
  akv_context_options o;
  akv_context_options_init(&o);
  o.backend = AKV_BACKEND_CUDA;
  o.device = device;
  o.allocator.user_data = &hooks;
  o.allocator.alloc = [](void *user, size_t bytes) -> void * {
    static_cast<Hooks *>(user)->record();
    void *p = nullptr;
    return cudaMalloc(&p, bytes) == cudaSuccess ? p : nullptr;
  };
  o.allocator.free = [](void *user, void *p, size_t) {
    static_cast<Hooks *>(user)->record();
    cudaFree(p);
  };
  cuda_ok(cudaSetDevice(caller), "cudaSetDevice");
  const auto current = [] {
    int d = -1;
    cuda_ok(cudaGetDevice(&d), "cudaGetDevice");
    return d;
  };
  {
    akv_context *raw = nullptr;
    ASSERT_EQ(akv_context_create(&o, &raw), AKV_OK) << akv_last_error_message();
    ContextPtr gpu(raw);
    Rng rng(11);
    PrefillSpec spec;
    spec.seq_len = 512;
    spec.kv_heads = 2;
    spec.group = 2;
    spec.head_dim = 64;
    const PrefillData data = make_prefill(rng, spec);
    ContextPtr cpu = make_context();
    CachePtr cache = deserialize(gpu.get(), serialize(compress(cpu.get(), data, anchorkv_options(0.2)).get()));
    EXPECT_EQ(current(), caller) << "after deserialize";
    ok(akv_cache_reserve(cache.get(), 64, nullptr), "akv_cache_reserve");
    EXPECT_EQ(current(), caller) << "after reserve";
    const Tensor q = make_tensor(nonzero_normal(rng, static_cast<size_t>(4) * 64), AKV_DTYPE_F32);
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");  // the query and output live on the context's device
    DeviceBuffer dq(q.bytes), dout(q.bytes.size());
    cuda_ok(cudaSetDevice(caller), "cudaSetDevice");
    ok(akv_decode(cache.get(), dq.get(), AKV_DTYPE_F32, 1, dout.get(), nullptr), "akv_decode");
    EXPECT_EQ(current(), caller) << "after decode";
    cuda_ok(cudaSetDevice(device), "cudaSetDevice");
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_ok(cudaSetDevice(caller), "cudaSetDevice");
  }
  EXPECT_EQ(current(), caller) << "after destroy";
  ASSERT_FALSE(hooks.seen.empty());
  for (const int d : hooks.seen) EXPECT_EQ(d, device);
}

}  // namespace
