// `anchorkv bench`: compress and decode timings of every method against FullKV, on the CPU
// backend and, when the library reports one, on a CUDA context. Inputs are one synthetic
// LLM-like layer (the generator of `anchorkv eval`). Medians over --repeats compresses and
// --decode-iters decode calls (after one warm-up call); --batch caches are decoded together
// through akv_decode_batch.
#include <cxxopts.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <memory>

#if defined(ANCHORKV_CLI_HAVE_CUDART)
#include <cuda_runtime_api.h>
#endif

#include "commands.hpp"
#include "common.hpp"
#include "methods.hpp"
#include "synthetic.hpp"

namespace akvcli {
namespace {

// A tensor in the memory a context reads: host memory for the CPU, device memory for CUDA.
class BackendBuffer {
 public:
  BackendBuffer(akv_backend backend, size_t bytes, const void *host_data = nullptr)
      : backend_(backend), bytes_(bytes) {
    if (backend_ == AKV_BACKEND_CPU) {
      host_.resize(bytes);
      if (host_data != nullptr) std::copy_n(static_cast<const uint8_t *>(host_data), bytes, host_.data());
      data_ = host_.data();
      return;
    }
#if defined(ANCHORKV_CLI_HAVE_CUDART)
    if (cudaMalloc(&data_, bytes) != cudaSuccess) throw CliError("cudaMalloc of " + std::to_string(bytes) + " bytes failed");
    if (host_data != nullptr && cudaMemcpy(data_, host_data, bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      throw CliError("cudaMemcpy to the device failed");
#else
    throw CliError("this anchorkv tool was built without the CUDA runtime");
#endif
  }
  ~BackendBuffer() {
#if defined(ANCHORKV_CLI_HAVE_CUDART)
    if (backend_ == AKV_BACKEND_CUDA && data_ != nullptr) cudaFree(data_);
#endif
  }
  BackendBuffer(const BackendBuffer &) = delete;
  BackendBuffer &operator=(const BackendBuffer &) = delete;
  void *data() { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  akv_backend backend_;
  size_t bytes_;
  std::vector<uint8_t> host_;
  void *data_ = nullptr;
};

// Waits for the device so that a host clock measures the work (CPU calls are synchronous).
void synchronize(akv_backend backend) {
#if defined(ANCHORKV_CLI_HAVE_CUDART)
  if (backend == AKV_BACKEND_CUDA && cudaDeviceSynchronize() != cudaSuccess)
    throw CliError("cudaDeviceSynchronize failed");
#else
  (void)backend;
#endif
}

struct BenchRow {
  BenchRow(std::string backend_, const MethodRun &run_) : backend(std::move(backend_)), run(run_) {}
  std::string backend;
  MethodRun run;
  std::string error;
  std::vector<double> compress_seconds, decode_seconds;
  uint64_t compressed_bytes = 0;
  double ratio = std::nan("");
};

struct BenchSettings {
  int repeats = 5, decode_iters = 20, batch = 1, threads = 0;
};

void bench_method(akv_context *context, akv_backend backend, const EvalShape &s, const PositionConfig &pc,
                  BackendBuffer &keys, BackendBuffer &values, BackendBuffer &q_window, BackendBuffer &queries,
                  BackendBuffer &out, const BenchSettings &settings, BenchRow &row) {
  const std::string label = row.backend + " " + row.run.entry->name + " " + row.run.target_label();
  akv_compress_options options = method_options(row.run, s.window, 0, 1);
  options.rope = pc.rope.to_library();
  options.keys_post_rope = pc.keys_post_rope ? 1 : 0;
  akv_prefill prefill;
  akv_prefill_init(&prefill);
  prefill.shape = akv_shape{s.seq_len, s.heads, s.q_heads, s.head_dim};
  prefill.dtype = AKV_DTYPE_F32;
  prefill.keys = keys.data();
  prefill.values = values.data();
  if (row.run.entry->uses_window_queries) {  // the last options.window of the window queries
    prefill.queries = static_cast<const float *>(q_window.data()) + static_cast<size_t>(s.window - options.window) * s.head_dim;
    prefill.q_head_stride = static_cast<int64_t>(s.window) * s.head_dim;
  }

  std::vector<CacheHandle> caches;
  const int compressions = std::max(settings.repeats, settings.batch);
  for (int i = 0; i < compressions; ++i) {
    akv_cache *raw = nullptr;
    synchronize(backend);
    Stopwatch clock;
    check(akv_compress(context, &prefill, &options, &raw, nullptr), label + ": akv_compress");
    synchronize(backend);
    if (i < settings.repeats) row.compress_seconds.push_back(clock.seconds());
    CacheHandle cache(raw);
    if (static_cast<int>(caches.size()) < settings.batch) caches.push_back(std::move(cache));
  }
  akv_cache_stats stats{};
  stats.struct_size = sizeof stats;
  check(akv_cache_stats_get(caches.front().get(), &stats), label + ": akv_cache_stats_get");
  row.compressed_bytes = stats.compressed_bytes;
  row.ratio = stats.ratio;

  std::vector<akv_cache *> raw_caches;
  for (auto &cache : caches) raw_caches.push_back(cache.get());
  auto decode_once = [&]() {
    if (settings.batch == 1)
      check(akv_decode(raw_caches[0], queries.data(), AKV_DTYPE_F32, 1, out.data(), nullptr), label + ": akv_decode");
    else
      check(akv_decode_batch(context, raw_caches.data(), settings.batch, queries.data(), AKV_DTYPE_F32, 1, out.data(),
                             nullptr),
            label + ": akv_decode_batch");
  };
  decode_once();  // warm-up
  synchronize(backend);
  for (int i = 0; i < settings.decode_iters; ++i) {
    Stopwatch clock;
    decode_once();
    synchronize(backend);
    row.decode_seconds.push_back(clock.seconds());
  }
}

}  // namespace

int run_bench(int argc, char **argv) {
  cxxopts::Options options("anchorkv bench",
                           "Time akv_compress and akv_decode of each method against FullKV on one synthetic\n"
                           "LLM-like layer (see anchorkv eval --help for the generator). CPU backend always; CUDA\n"
                           "when the library reports a CUDA backend (skipped on AKV_ERR_BACKEND_UNAVAILABLE).\n"
                           "Medians over --repeats compresses and --decode-iters decode calls.\n");
  options.set_width(100);
  // clang-format off
  options.add_options()
    ("seq-len", "Prompt length S", cxxopts::value<int64_t>()->default_value("32768"), "S")
    ("heads", "KV heads H", cxxopts::value<int>()->default_value("8"), "H")
    ("q-heads", "Query heads Hq", cxxopts::value<int>()->default_value("32"), "HQ")
    ("head-dim", "Head dimension D", cxxopts::value<int>()->default_value("128"), "D")
    ("ratios", "Compression ratios or retain fractions", cxxopts::value<std::string>()->default_value("5,10,20"), "LIST")
    ("methods", "Methods besides FullKV: default, all, or names (" + method_names() + ")", cxxopts::value<std::string>()->default_value("default"), "LIST")
    ("repeats", "Timed compress calls per method (median reported)", cxxopts::value<int>()->default_value("3"), "N")
    ("decode-iters", "Timed decode calls per method (median reported)", cxxopts::value<int>()->default_value("20"), "N")
    ("batch", "Caches decoded per call (akv_decode_batch when > 1)", cxxopts::value<int>()->default_value("1"), "N")
    ("backend", "all (CPU, then CUDA when available), cpu or cuda", cxxopts::value<std::string>()->default_value("all"), "B")
    ("threads", "CPU worker threads (0 = all)", cxxopts::value<int>()->default_value("0"), "N")
    ("seed", "Seed of the synthetic layer", cxxopts::value<uint64_t>()->default_value("1"), "N")
    ("key-space", "pre: keys handed pre-RoPE with the layer's RoPE; post: rotated here and handed with "
                  "no RoPE, so that anchors are fitted after the rotation (an experiment: docs/design.md)",
     cxxopts::value<std::string>()->default_value("pre"), "pre|post")
    ("rope-style", "neox: rotate-half pairs (j, j + D/2), the generator's; gptj: interleaved pairs (2j, "
                   "2j + 1), the same layer with its key and query dims reordered to match (GGUF's layout)",
     cxxopts::value<std::string>()->default_value("neox"), "neox|gptj")
    ("csv", "Print CSV instead of the table")
    ("json", "Print JSON instead of the table")
    ("quiet", "No progress on stderr")
    ("h,help", "Show this help");
  // clang-format on
  const cxxopts::ParseResult args = parse_arguments(options, argc, argv, "anchorkv bench --help");
  if (args.count("help")) {
    std::printf("%s", options.help().c_str());
    return kExitOk;
  }
  if (!args.unmatched().empty())
    throw CliError("unexpected argument \"" + args.unmatched().front() + "\" (see anchorkv bench --help)", kExitUsage);

  BenchSettings settings;
  settings.repeats = args["repeats"].as<int>();
  settings.decode_iters = args["decode-iters"].as<int>();
  settings.batch = args["batch"].as<int>();
  settings.threads = args["threads"].as<int>();
  if (settings.repeats < 1 || settings.decode_iters < 1 || settings.batch < 1 || settings.threads < 0)
    throw CliError("--repeats, --decode-iters and --batch must be >= 1, --threads >= 0", kExitUsage);
  const bool csv = args.count("csv") > 0, json = args.count("json") > 0, quiet = args.count("quiet") > 0;
  if (csv && json) throw CliError("--csv and --json are exclusive", kExitUsage);
  const std::string backend_choice = args["backend"].as<std::string>();
  if (backend_choice != "all" && backend_choice != "cpu" && backend_choice != "cuda")
    throw CliError("--backend must be all, cpu or cuda", kExitUsage);
  const std::vector<MethodRun> plan =
      plan_methods(args["methods"].as<std::string>(), parse_ratios(args["ratios"].as<std::string>()));

  SyntheticConfig config;
  config.shape.layers = 1;
  config.shape.seq_len = args["seq-len"].as<int64_t>();
  config.shape.heads = args["heads"].as<int>();
  config.shape.q_heads = args["q-heads"].as<int>();
  config.shape.head_dim = args["head-dim"].as<int>();
  config.shape.window = widest_window(plan);
  config.shape.future = 1;
  config.seed = args["seed"].as<uint64_t>();
  config.threads = settings.threads;
  const EvalShape &s = config.shape;
  if (s.heads < 1 || s.q_heads < 1 || s.q_heads % s.heads != 0 || s.head_dim < 4 || s.window < 1 ||
      s.seq_len <= s.window)
    throw CliError("bad shape: need H >= 1, Hq a multiple of H, D >= 4, 1 <= W < S", kExitUsage);
  SyntheticSource source(config);
  auto say = [&](const std::string &text) {
    if (!quiet) std::cerr << "anchorkv bench: " << text << std::endl;
  };
  const std::string key_space = args["key-space"].as<std::string>();
  if (key_space != "pre" && key_space != "post") throw CliError("--key-space must be pre or post", kExitUsage);
  say("generating " + source.describe());
  LayerTensors layer = source.load(0);
  PositionConfig positions = source.positions();
  const std::string rope_style = args["rope-style"].as<std::string>();
  if (rope_style != "neox" && rope_style != "gptj") throw CliError("--rope-style must be neox or gptj", kExitUsage);
  if (rope_style == "gptj") {  // dims (j, j + D/2) -> (2j, 2j + 1): the same attention under GPT-J pairs
    const int D = s.head_dim, half = D / 2;
    std::vector<float> row(D);
    auto reorder = [&](std::vector<float> &rows) {
      for (size_t r = 0; r < rows.size(); r += D) {
        for (int j = 0; j < half; ++j) {
          row[2 * j] = rows[r + j];
          row[2 * j + 1] = rows[r + j + half];
        }
        std::copy(row.begin(), row.end(), rows.begin() + static_cast<std::ptrdiff_t>(r));
      }
    };
    if (D % 2 != 0 || (positions.rope.rotary_dim != 0 && positions.rope.rotary_dim != D))
      throw CliError("--rope-style gptj needs an even D and RoPE on every dim", kExitUsage);
    reorder(layer.keys);
    reorder(layer.q_window);
    reorder(layer.q_future);
    positions.rope.style = AKV_ROPE_GPTJ;
  }
  if (key_space == "post") {  // every key rotated to its position, and no RoPE for the library
    if (!positions.keys_post_rope) {
      const Rotary rotary(positions.rope, s.head_dim);
      for (int h = 0; h < s.heads; ++h)
        for (int64_t t = 0; t < s.seq_len; ++t)
          rotary.apply(&layer.keys[(static_cast<size_t>(h) * s.seq_len + t) * s.head_dim],
                       static_cast<double>(positions.position_offset + t));
    }
    positions.rope.style = AKV_ROPE_NONE;
    positions.keys_post_rope = false;
  }
  // Decode queries: the held-out query of each head, the same for every cache of the batch.
  std::vector<float> batch_queries;
  for (int b = 0; b < settings.batch; ++b)
    batch_queries.insert(batch_queries.end(), layer.q_future.begin(), layer.q_future.end());

  std::vector<akv_backend> backends;
  if (backend_choice != "cuda") backends.push_back(AKV_BACKEND_CPU);
  if (backend_choice != "cpu") backends.push_back(AKV_BACKEND_CUDA);
  std::vector<BenchRow> rows;
  std::vector<std::string> skipped;
  bool any_failed = false;
  for (akv_backend backend : backends) {
    const std::string name = backend == AKV_BACKEND_CUDA ? "cuda" : "cpu";
    akv_status status = AKV_OK;
    ContextHandle context = create_context(backend, settings.threads, &status);
    if (!context) {
      skipped.push_back(name + ": " + describe_status(status));
      say("skipping " + name + ": " + describe_status(status));
      if (backend_choice == "cuda") any_failed = true;
      continue;
    }
#if !defined(ANCHORKV_CLI_HAVE_CUDART)
    if (backend == AKV_BACKEND_CUDA) {
      skipped.push_back(name + ": the library has a CUDA backend but this tool was built without the CUDA runtime");
      say("skipping " + skipped.back());
      continue;
    }
#endif
    BackendBuffer keys(backend, layer.keys.size() * 4, layer.keys.data());
    BackendBuffer values(backend, layer.values.size() * 4, layer.values.data());
    BackendBuffer q_window(backend, layer.q_window.size() * 4, layer.q_window.data());
    BackendBuffer queries(backend, batch_queries.size() * 4, batch_queries.data());
    BackendBuffer out(backend, batch_queries.size() * 4);
    for (const MethodRun &run : plan) {
      BenchRow row(name, run);
      Stopwatch clock;
      try {
        bench_method(context.get(), backend, s, positions, keys, values, q_window, queries, out, settings, row);
      } catch (const CliError &error) {
        row.error = error.what();
        // A method the CUDA backend does not implement yet is a gap to report, not a failure.
        if (!(backend == AKV_BACKEND_CUDA && error.status() == AKV_ERR_UNSUPPORTED)) any_failed = true;
        std::cerr << "anchorkv bench: " << row.error << std::endl;
      }
      say(name + " " + run.entry->name + " " + run.target_label() + " done (" +
          format_seconds(clock.seconds()) + ")");
      rows.push_back(std::move(row));
    }
  }

  auto fullkv_decode = [&](const std::string &backend) {
    for (const BenchRow &row : rows)
      if (row.backend == backend && row.run.entry->method == AKV_METHOD_FULLKV && row.error.empty())
        return median(row.decode_seconds);
    return std::nan("");
  };
  if (json) {
    nlohmann::json out;
    out["tool"] = "anchorkv bench";
    out["library_version"] = akv_version_string();
    out["shape"] = {{"seq_len", s.seq_len}, {"kv_heads", s.heads}, {"q_heads", s.q_heads},
                    {"head_dim", s.head_dim}, {"window", s.window}};
    out["repeats"] = settings.repeats;
    out["decode_iters"] = settings.decode_iters;
    out["batch"] = settings.batch;
    out["skipped_backends"] = skipped;
    nlohmann::json list = nlohmann::json::array();
    for (const BenchRow &row : rows) {
      nlohmann::json r = {{"backend", row.backend}, {"method", row.run.entry->name},
                          {"retain_fraction", row.run.retain_fraction}, {"target_ratio", row.run.target_ratio()}};
      if (!row.error.empty()) {
        r["error"] = row.error;
      } else {
        r["ratio"] = row.ratio;
        r["compressed_bytes"] = row.compressed_bytes;
        r["compress_seconds"] = row.compress_seconds;
        r["compress_seconds_median"] = median(row.compress_seconds);
        r["decode_seconds_median"] = median(row.decode_seconds);
        r["decode_vs_fullkv"] = median(row.decode_seconds) / fullkv_decode(row.backend);
      }
      list.push_back(r);
    }
    out["rows"] = list;
    std::printf("%s\n", out.dump(2).c_str());
  } else if (csv) {
    std::printf("backend,method,target_ratio,ratio,compressed_bytes,compress_s_median,decode_s_median,"
                "decode_vs_fullkv,batch,error\n");
    for (const BenchRow &row : rows) {
      if (!row.error.empty()) {
        std::printf("%s,%s,%.6g,,,,,,%d,\"%s\"\n", row.backend.c_str(), row.run.entry->name, row.run.target_ratio(),
                    settings.batch, row.error.c_str());
        continue;
      }
      std::printf("%s,%s,%.6g,%.6f,%llu,%.6g,%.6g,%.4f,%d,\n", row.backend.c_str(), row.run.entry->name,
                  row.run.target_ratio(), row.ratio, static_cast<unsigned long long>(row.compressed_bytes),
                  median(row.compress_seconds), median(row.decode_seconds),
                  median(row.decode_seconds) / fullkv_decode(row.backend), settings.batch);
    }
  } else {
    std::printf("anchorkv bench: S=%lld H=%d Hq=%d D=%d W=%d, batch %d; medians of %d compresses and %d decode calls "
                "(one query per head)\n\n",
                static_cast<long long>(s.seq_len), s.heads, s.q_heads, s.head_dim, s.window, settings.batch,
                settings.repeats, settings.decode_iters);
    std::printf("%-7s %-10s %7s %8s %12s %12s %12s %10s\n", "backend", "method", "target", "ratio", "bytes", "compress",
                "decode/call", "vs FullKV");
    for (const BenchRow &row : rows) {
      if (!row.error.empty()) {
        std::printf("%-7s %-10s %7s  FAILED: %s\n", row.backend.c_str(), row.run.entry->name,
                    row.run.target_label().c_str(), row.error.c_str());
        continue;
      }
      std::printf("%-7s %-10s %7s %8s %12llu %12s %12s %10s\n", row.backend.c_str(), row.run.entry->name,
                  row.run.target_label().c_str(), (format_fixed(row.ratio, 2) + "x").c_str(),
                  static_cast<unsigned long long>(row.compressed_bytes),
                  format_seconds(median(row.compress_seconds)).c_str(),
                  format_seconds(median(row.decode_seconds)).c_str(),
                  (format_fixed(median(row.decode_seconds) / fullkv_decode(row.backend), 2) + "x").c_str());
    }
    for (const std::string &skip : skipped) std::printf("skipped %s\n", skip.c_str());
  }
  return any_failed ? kExitFailure : kExitOk;
}

}  // namespace akvcli
