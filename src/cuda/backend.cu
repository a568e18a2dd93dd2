// CUDA backend: memory movement, device views of caches, decode and append launches.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include "core/compress_stages.hpp"
#include "core/error.hpp"
#include "core/method_traits.hpp"
#include "cuda/backend.hpp"
#include "cuda/cuda_util.cuh"
#include "cuda/decode_kernels.cuh"
#include "cuda/head_dim.hpp"
#include "cuda/plan.hpp"

namespace akv {
namespace cuda {
namespace {

cudaStream_t as_stream(void *stream) { return static_cast<cudaStream_t>(stream); }

// Allows `kernel` the device's whole shared memory, once per context (a context has one
// device; the attribute is per device and kernel). The context's device is current.
template <typename Kernel>
void allow_all_shared_memory(akv_context &ctx, Kernel *kernel) {
  const void *key = reinterpret_cast<const void *>(kernel);
  std::lock_guard<std::mutex> lock(state(ctx).mutex);
  if (state(ctx).smem_kernels.count(key)) return;
  check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(state(ctx).smem_optin)),
        "cudaFuncSetAttribute(MaxDynamicSharedMemorySize)");
  state(ctx).smem_kernels.insert(key);
}

// ANCHORKV_DECODE_PROFILE set (not "" or "0"): each decode launch outside a capture times its
// kernels with events and prints one stderr line, for checking scripts/predict_decode.py's
// parts on a device (each time from the event before the kernel's launch to the one after it,
// so a launch gap counts with the kernel behind it); the launch then waits for its kernels.
bool decode_profiling() { return env_switch("ANCHORKV_DECODE_PROFILE"); }

class DecodeProfile {
 public:
  explicit DecodeProfile(cudaStream_t stream) : stream_(stream) {
    for (auto &e : events_) check(cudaEventCreate(&e), "cudaEventCreate (decode profile)");
  }
  ~DecodeProfile() {
    for (auto &e : events_) cudaEventDestroy(e);
  }
  void mark(int i) { check(cudaEventRecord(events_[i], stream_), "cudaEventRecord (decode profile)"); }
  // After mark(3): the split, anchor values (none without anchor parts) and merge kernels.
  void report(const DecodePlan &plan, int D, int maxrows, bool fast, int32_t requests, int heads) {
    check(cudaEventSynchronize(events_[3]), "cudaEventSynchronize (decode profile)");
    float ms[3] = {};
    for (int i = 0; i < 3; ++i) check(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]), "cudaEventElapsedTime");
    const int rows_blocks = heads * plan.row_chunks * requests;
    std::fprintf(stderr,
                 "anchorkv decode profile D=%d rows=%d fast=%d requests=%d: split %.1f us (%lld x %d blocks); "
                 "anchor values %.1f us (%lld x %d blocks); merge %.1f us (%d x %d blocks); total %.1f us\n",
                 D, maxrows, fast ? 1 : 0, static_cast<int>(requests), 1e3 * ms[0], static_cast<long long>(plan.splits),
                 rows_blocks, 1e3 * ms[1], static_cast<long long>(plan.anchor_parts), rows_blocks, 1e3 * ms[2],
                 maxrows, rows_blocks, 1e3 * (ms[0] + ms[1] + ms[2]));
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t events_[4] = {};
};

// ANCHORKV_DECODE_PDL=0: the anchor values' and merge kernels launched plainly, each after the
// kernel before it has completed (for measuring what programmatic dependent launch saves).
bool decode_pdl_allowed() {
  const char *v = std::getenv("ANCHORKV_DECODE_PDL");
  return !(v && std::strcmp(v, "0") == 0);
}

// A decode kernel after the one before it on `stream`; `programmatic`: with programmatic
// dependent launch (sm_90 and later), so that its blocks are placed, and do what needs none of
// the earlier kernel's results, while that kernel's last blocks run (grid_dependency_wait in
// the kernel, device_common.cuh). A captured launch keeps the relation as a programmatic edge.
template <typename Kernel>
void launch_after(bool programmatic, Kernel *kernel, dim3 grid, cudaStream_t stream, const DecodeLaunch &p) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kDecodeThreads);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attribute[1] = {};
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = programmatic ? 1 : 0;
  check(cudaLaunchKernelEx(&config, kernel, p), "cudaLaunchKernelEx (a decode kernel)");
}

template <int D, int MAXROWS, bool FAST, bool GPTJ>
void launch_decode(akv_context &ctx, const DecodePlan &plan, const DecodeLaunch &p, int32_t requests,
                   cudaStream_t stream) {
  allow_all_shared_memory(ctx, decode_split_kernel<D, MAXROWS, FAST, GPTJ>);
  std::unique_ptr<DecodeProfile> profile;
  if (decode_profiling() && !capturing(stream)) profile = std::make_unique<DecodeProfile>(stream);
  if (profile) profile->mark(0);
  const DecodeGrids g = decode_grids(plan, p.heads, requests);
  // Caches without RoPE on the register-gather path: their anchors' scores first (a profile
  // counts them in the split kernel's time).
  if (FAST && p.scores)
    decode_scores_kernel<D, MAXROWS><<<dim3(g.scores.x, g.scores.y, g.scores.z), kDecodeThreads, 0, stream>>>(p);
  decode_split_kernel<D, MAXROWS, FAST, GPTJ><<<dim3(g.split.x, g.split.y, g.split.z), kDecodeThreads,
                                                plan.smem_bytes, stream>>>(p);
  if (profile) profile->mark(1);
  // Profiled: every kernel after the one before it, so that the events between them time each.
  const bool programmatic = state(ctx).programmatic_launch && !profile;
  if (plan.anchor_parts > 0)
    launch_after(programmatic, decode_anchor_values_kernel<D, MAXROWS>,
                 dim3(g.anchor_values.x, g.anchor_values.y, g.anchor_values.z), stream, p);
  if (profile) profile->mark(2);
  launch_after(programmatic, decode_merge_kernel<D, MAXROWS>, dim3(g.merge.x, g.merge.y, g.merge.z), stream, p);
  if (profile) {
    profile->mark(3);
    profile->report(plan, D, MAXROWS, FAST, requests, p.heads);
  }
}

// Split blocks of decode_split_kernel<D, MAXROWS, FAST, GPTJ> resident on one multiprocessor, asked
// once per device, kernel and shared-memory size (a decode, captured or not, then makes no query).
template <int D, int MAXROWS, bool FAST, bool GPTJ>
int resident_split_blocks(akv_context &ctx, size_t smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void *, size_t>, int> known;
  const auto kernel = decode_split_kernel<D, MAXROWS, FAST, GPTJ>;
  const auto key = std::make_tuple(ctx.device, reinterpret_cast<const void *>(kernel), smem);
  {
    std::lock_guard<std::mutex> lock(mutex);
    const auto it = known.find(key);
    if (it != known.end()) return it->second;
  }
  allow_all_shared_memory(ctx, kernel);
  int n = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kDecodeThreads, smem),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  std::lock_guard<std::mutex> lock(mutex);
  known[key] = n;
  return n;
}

template <int D, bool FAST, bool GPTJ>
int resident_rows(akv_context &ctx, int maxrows, size_t smem) {
  switch (maxrows) {
    case 4: return resident_split_blocks<D, 4, FAST, GPTJ>(ctx, smem);
    case 8: return resident_split_blocks<D, 8, FAST, GPTJ>(ctx, smem);
    default: return resident_split_blocks<D, 16, FAST, GPTJ>(ctx, smem);
  }
}

template <int D, bool FAST, bool GPTJ>
void launch_decode_rows(akv_context &ctx, const DecodePlan &plan, const DecodeLaunch &p, int32_t requests,
                        cudaStream_t stream) {
  switch (plan.maxrows) {
    case 4: return launch_decode<D, 4, FAST, GPTJ>(ctx, plan, p, requests, stream);
    case 8: return launch_decode<D, 8, FAST, GPTJ>(ctx, plan, p, requests, stream);
    default: return launch_decode<D, 16, FAST, GPTJ>(ctx, plan, p, requests, stream);
  }
}

}  // namespace

void *workspace(akv_context &ctx, size_t bytes, void *raw_stream, int use) {
  const cudaStream_t stream = as_stream(raw_stream);
  std::lock_guard<std::mutex> lock(state(ctx).mutex);
  CudaBackend::Workspace &ws = state(ctx).workspaces[{raw_stream, use}];
  if (ws.bytes >= bytes) return ws.ptr;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone)
    fail(AKV_ERR_INVALID_ARGUMENT, "decode needs ", bytes, " bytes of workspace on this stream and has ", ws.bytes,
         "; run one decode with this batch shape on this stream before capturing it in a CUDA graph");
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");  // earlier decodes may still use it
  ctx.deallocate(ws.ptr, ws.bytes);
  ws = {};
  ws.ptr = ctx.allocate(bytes);
  ws.bytes = bytes;
  return ws.ptr;
}

void copy(void *dst, const void *src, size_t bytes, void *stream, bool wait) {
  if (bytes == 0) return;
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, as_stream(stream)), "cudaMemcpyAsync");
  if (wait) check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
}

void copy_rows(void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t row_bytes, size_t rows,
               void *stream) {
  if (row_bytes == 0 || rows == 0) return;
  check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, cudaMemcpyDefault, as_stream(stream)),
        "cudaMemcpy2DAsync");
}

void synchronize(void *stream) { check(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize"); }

void upload_view(akv_cache &cache, void *stream) {
  DeviceScope scope(cache.context->device);
  ViewAddresses at;
  at.data = cache.data.data();
  at.suffix_keys = reinterpret_cast<uint16_t *>(cache.suffix_keys.data());
  at.suffix_values = reinterpret_cast<uint16_t *>(cache.suffix_values.data());
  std::vector<int64_t> anchor_tokens;  // format 3: the per-tile anchor masks come from this list
  if (storage_of(cache.meta.method) == Storage::kAnchor && cache.geometry.format == 3) {
    const Section &list = cache.layout.sections[kAnchorTokens];
    anchor_tokens.resize(list.bytes / sizeof(int64_t));
    copy(anchor_tokens.data(), cache.data.data() + list.offset, list.bytes, stream, /*wait=*/true);
    at.host_anchor_tokens = anchor_tokens.data();
  }
  const size_t bytes = build_view_block(cache, at).size();
  if (cache.device_view.size() != bytes) {
    synchronize(stream);  // a pending kernel may still read the old view
    cache.device_view = Buffer(cache.context, bytes);
  }
  at.aux = cache.device_view.data();
  const std::vector<uint8_t> block = build_view_block(cache, at);
  copy(cache.device_view.data(), block.data(), block.size(), stream, /*wait=*/true);
}

void decode(akv_context &ctx, akv_cache *const *caches, int32_t batch, const void *queries, akv_dtype dtype,
            int32_t q_len, void *out, float *lse, void *stream) {
  DeviceScope scope(ctx.device);
  if (state(ctx).sm_count == 0) {
    int sms = 0, optin = 0;
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx.device), "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, ctx.device), "cudaDeviceGetAttribute");
    int pools = 0, major = 0;
    check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, ctx.device), "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, ctx.device), "cudaDeviceGetAttribute");
    state(ctx).smem_optin = static_cast<size_t>(optin);
    state(ctx).memory_pools = pools != 0;
    state(ctx).programmatic_launch = major >= 9 && decode_pdl_allowed();
    state(ctx).sm_count = sms;
  }
  const akv_shape &s = caches[0]->meta.shape;
  const int D = s.head_dim;
  const bool fast = fast_decode_path(caches, batch, dtype);  // every launch of this decode: all its caches
  const bool gptj = fast && fast_decode_gptj(caches);
  const DecodePlan plan = plan_decode(caches, batch, q_len, state(ctx).sm_count, state(ctx).smem_optin, [&](int maxrows, size_t smem) {
    int resident = 0;
    with_head_dim(D, [&](auto d) {
      with_split_path(fast, gptj, [&](auto f, auto g) {
        resident = resident_rows<decltype(d)::value, decltype(f)::value, decltype(g)::value>(ctx, maxrows, smem);
      });
    });
    return resident;
  });
  const cudaStream_t st = as_stream(stream);
  // Under capture the workspace is allocated inside the graph (a stream-ordered allocation
  // becomes the graph's own memory node), so a replay on any stream never shares scratch
  // with the capture stream's later decodes or with another graph. Otherwise the stream's
  // workspace, kept between calls.
  const bool graph_owned = state(ctx).memory_pools && capturing(stream);
  float *ws = nullptr;
  if (graph_owned)
    check(cudaMallocAsync(reinterpret_cast<void **>(&ws), std::max<size_t>(plan.workspace_bytes, 16), st),
          "cudaMallocAsync (the captured decode's workspace)");
  else
    ws = static_cast<float *>(workspace(ctx, plan.workspace_bytes, stream, CudaBackend::kDecodeWorkspace));
  const size_t esize = dtype == AKV_DTYPE_F32 ? 4 : 2;
  const size_t per_request = static_cast<size_t>(s.num_q_heads) * q_len * s.head_dim * esize;
  for (int32_t b0 = 0; b0 < batch; b0 += kMaxBatchPerLaunch) {
    const int32_t n = std::min(batch - b0, kMaxBatchPerLaunch);
    DecodeLaunch p = decode_launch(plan, s, q_len, dtype, static_cast<const uint8_t *>(queries) + b0 * per_request,
                                   static_cast<uint8_t *>(out) + b0 * per_request, ws);
    p.lse = lse ? lse + static_cast<size_t>(b0) * s.num_q_heads * q_len : nullptr;
    for (int32_t i = 0; i < n; ++i) p.views[i] = reinterpret_cast<const CacheView *>(caches[b0 + i]->device_view.data());
    with_head_dim(D, [&](auto d) {
      with_split_path(fast, gptj, [&](auto f, auto g) {
        launch_decode_rows<decltype(d)::value, decltype(f)::value, decltype(g)::value>(ctx, plan, p, n, st);
      });
    });
    check(cudaGetLastError(), "the decode kernel launch");
  }
  if (graph_owned) check(cudaFreeAsync(ws, st), "cudaFreeAsync (the captured decode's workspace)");
}

void append(akv_cache &cache, const void *keys, const void *values, akv_dtype dtype, int32_t n,
            const int32_t *positions, void *stream) {
  DeviceScope scope(cache.context->device);
  const cudaStream_t st = as_stream(stream);
  CacheView *view = reinterpret_cast<CacheView *>(cache.device_view.data());
  for (int32_t t0 = 0; t0 < n; t0 += kMaxAppendPerLaunch) {
    AppendLaunch a{};
    a.view = view;
    a.keys = keys;
    a.values = values;
    a.dtype = dtype;
    a.n_total = n;
    a.token0 = t0;
    a.n = std::min(n - t0, kMaxAppendPerLaunch);
    a.implicit = positions ? 0 : 1;
    for (int32_t i = 0; positions && i < a.n; ++i) a.positions[i] = positions[t0 + i];
    append_rows_kernel<<<dim3(a.n, cache.meta.shape.num_kv_heads), 64, 0, st>>>(a);
    append_commit_kernel<<<1, 1, 0, st>>>(a);
    check(cudaGetLastError(), "the append kernel launch");
  }
}

bool capturing(void *stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(as_stream(stream), &capture), "cudaStreamIsCapturing");
  return capture != cudaStreamCaptureStatusNone;
}

AppendedOnDevice read_appended(akv_cache &cache, int64_t known) {
  DeviceScope scope(cache.context->device);
  // Replays of a captured append may run on any stream.
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  CacheView v;
  check(cudaMemcpy(&v, cache.device_view.data(), sizeof v, cudaMemcpyDeviceToHost), "cudaMemcpy");
  AppendedOnDevice r;
  r.length = v.suffix_len;
  r.next_position = v.next_position;
  r.dropped = v.dropped;
  if (v.suffix_len > known) {
    r.positions.resize(static_cast<size_t>(v.suffix_len - known));
    check(cudaMemcpy(r.positions.data(), v.suffix_positions + known, r.positions.size() * sizeof(int32_t),
                     cudaMemcpyDeviceToHost),
          "cudaMemcpy");
  }
  if (v.dropped) {  // reported once
    const int32_t zero = 0;
    check(cudaMemcpy(cache.device_view.data() + offsetof(CacheView, dropped), &zero, sizeof zero, cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }
  return r;
}

}  // namespace cuda
}  // namespace akv
