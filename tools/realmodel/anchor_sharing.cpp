// How many of a warp's tokens share a value anchor, on a real prompt: the rounds that the CUDA
// decode's per-anchor-weight atomics take (prefix_values in src/cuda/decode_kernels.cuh: a
// shared-memory float add is a compare-and-swap loop, one success per address a round, so a
// round per token of the warp's most shared anchor). A warp adds the weights of 8 tokens 8
// apart in a 64-token tile, for four rows (different addresses); it used to take 32
// consecutive tokens of one row. scripts/sass_count.py charges the measured mean (CAS_ROUNDS).
// Also the distribution of a 64-token tile's key and value residual counts (the popcounts of
// its mask words), whose spread sets how often a tile's residual warps and staging trips wait
// longer (COUNT_DISPERSION there).
//
// Compresses layers of a tools/realmodel/dump.py file (f32 or bf16; keys pre-RoPE, GPT-J RoPE
// as its metadata says) with the default options at 5x, 10x and 20x on the CPU backend, and reads the
// assignments through the library's internal AnchorAccess. Built with the tests
// (tests/CMakeLists.txt):
//
//   build/tests/anchorkv_anchor_sharing /tmp/realmodel/paper_8k.safetensors
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include <anchorkv/anchorkv.h>
#include "core/anchor_access.hpp"
#include "core/context.hpp"
#include "core/dtype.hpp"

namespace {

struct Dump {
  std::ifstream file;
  uint64_t data_start = 0;
  nlohmann::json header;

  explicit Dump(const std::string &path) : file(path, std::ios::binary) {
    uint64_t n = 0;
    file.read(reinterpret_cast<char *>(&n), 8);
    std::string text(n, '\0');
    file.read(text.data(), static_cast<std::streamsize>(n));
    if (!file) throw std::runtime_error("cannot read the header of " + path);
    header = nlohmann::json::parse(text);
    data_start = 8 + n;
  }
  std::vector<int64_t> shape(const std::string &name) const { return header.at(name).at("shape"); }
  // Elements [first, first + count) of an F32 or BF16 tensor, as f32.
  std::vector<float> read(const std::string &name, int64_t first, int64_t count) {
    const std::string dtype = header.at(name).at("dtype");
    if (dtype != "F32" && dtype != "BF16") throw std::runtime_error(name + ": F32 or BF16 tensors only");
    const int64_t size = dtype == "F32" ? 4 : 2;
    std::vector<float> out(static_cast<size_t>(count));
    file.seekg(static_cast<std::streamoff>(data_start + header.at(name).at("data_offsets")[0].get<uint64_t>() + size * first));
    if (size == 4) {
      file.read(reinterpret_cast<char *>(out.data()), static_cast<std::streamsize>(4 * count));
    } else {
      std::vector<uint16_t> raw(static_cast<size_t>(count));
      file.read(reinterpret_cast<char *>(raw.data()), static_cast<std::streamsize>(2 * count));
      for (size_t i = 0; i < raw.size(); ++i) out[i] = akv::bf16_to_float(raw[i]);
    }
    if (!file) throw std::runtime_error("cannot read " + name);
    return out;
  }
};

}  // namespace

int main(int argc, char **argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DUMP.safetensors\n", argv[0]);
    return 2;
  }
  Dump dump(argv[1]);
  const auto ks = dump.shape("k"), qs = dump.shape("q_window");  // [L][H][S][D], [L][Hq][W][D]
  const int L = static_cast<int>(ks[0]), H = static_cast<int>(ks[1]), D = static_cast<int>(ks[3]);
  const int64_t S = ks[2];
  const int Hq = static_cast<int>(qs[1]), WQ = static_cast<int>(qs[2]);
  const auto &meta = dump.header.at("__metadata__");
  if (meta.value("keys_post_rope", "0") != "0") throw std::runtime_error("keys pre-RoPE only");
  akv_context *ctx = nullptr;
  if (akv_context_create(nullptr, &ctx) != AKV_OK) return 1;
  std::printf("%s: %d layers x %d KV heads, S %lld; the most prefix tokens of a warp on one value anchor (mean)\n",
              argv[1], L, H, static_cast<long long>(S));
  std::printf("| ratio | tiles | 8 tokens 8 apart (the kernel's) | 32 consecutive (before) |\n|---|---|---|---|\n");
  // A tile's key and value residual counts (popcounts of its mask words): their sums, squares
  // and product, and how many tiles hold 0 .. kCountMax - 2 and kCountMax - 1 or more a side.
  constexpr int kCountMax = 10;
  struct Residuals {
    double hist[2][kCountMax] = {}, sum[2] = {}, square[2] = {}, product = 0;
    int64_t tiles = 0;
  };
  std::vector<std::pair<double, Residuals>> residuals;
  for (const double ratio : {5.0, 10.0, 20.0}) {
    double strided = 0, consecutive = 0;
    int64_t tiles = 0;
    Residuals res;
    for (int l = 0; l < L; l += std::max(1, L / 6)) {
      const int64_t kv = static_cast<int64_t>(H) * S * D;
      const auto k = dump.read("k", l * kv, kv), v = dump.read("v", l * kv, kv);
      const auto q = dump.read("q_window", static_cast<int64_t>(l) * Hq * WQ * D, static_cast<int64_t>(Hq) * WQ * D);
      akv_compress_options o;
      akv_compress_options_init(&o);
      o.retain_fraction = 1.0 / ratio;
      o.rope.style = meta.value("rope_style", "neox") == "gptj" ? AKV_ROPE_GPTJ : AKV_ROPE_NEOX;
      o.rope.base = std::stod(meta.value("rope_base", "10000"));
      akv_prefill p{};
      p.struct_size = sizeof p;
      p.shape = {S, H, Hq, D};
      p.dtype = AKV_DTYPE_F32;
      p.keys = k.data();
      p.values = v.data();
      p.queries = q.data() + static_cast<size_t>(WQ - o.window) * D;  // the last `window` rows
      p.q_head_stride = static_cast<int64_t>(WQ) * D;
      akv_cache *cache = nullptr;
      if (akv_compress(ctx, &p, &o, &cache, nullptr) != AKV_OK) {
        std::fprintf(stderr, "compress: %s\n", akv_last_error_message());
        return 1;
      }
      const akv::AnchorAccess access(*cache);
      const int64_t P = cache->geometry.prefix;
      // The most tokens of the group on one anchor: tokens t0 + first + step * j, j < n.
      const auto most = [&](int h, int64_t first, int step, int n) {
        std::map<int32_t, int> count;
        int m = 0;
        for (int j = 0; j < n; ++j) m = std::max(m, ++count[access.anchor(1, h, first + step * j)]);
        return m;
      };
      const uint64_t *masks[2] = {cache->section<uint64_t>(akv::kKeyMask), cache->section<uint64_t>(akv::kValueMask)};
      const int64_t words = cache->geometry.words;
      for (int h = 0; h < H; ++h)
        for (int64_t t0 = 0; t0 + 64 <= P; t0 += 64, ++tiles) {
          for (int w = 0; w < 8; ++w) strided += most(h, t0 + w, 8, 8) / 8.0;
          consecutive += (most(h, t0, 1, 32) + most(h, t0 + 32, 1, 32)) / 2.0;
          int c[2];
          for (int side = 0; side < 2; ++side) {
            c[side] = __builtin_popcountll(masks[side][h * words + t0 / 64]);
            res.sum[side] += c[side];
            res.square[side] += static_cast<double>(c[side]) * c[side];
            res.hist[side][std::min(c[side], kCountMax - 1)] += 1;
          }
          res.product += static_cast<double>(c[0]) * c[1];
        }
      akv_cache_destroy(cache);
    }
    std::printf("| %gx | %lld | %.2f | %.2f |\n", ratio, static_cast<long long>(tiles), strided / tiles,
                consecutive / tiles);
    res.tiles = tiles;
    residuals.emplace_back(ratio, res);
  }
  std::printf("\nA prefix tile's key and value residual counts (its 64-token mask words), every head of the same "
              "layers: fractions f (mean / 64), dispersion (variance / mean: 1 for residuals spread evenly, "
              "Poisson; scripts/sass_count.py's COUNT_DISPERSION), correlation, and the odds of 0 .. 9 and more\n");
  std::printf("| ratio | tiles | f_K | f_V | dispersion K | dispersion V | corr(K, V) | key counts | value counts |\n"
              "|---|---|---|---|---|---|---|---|---|\n");
  for (const auto &[ratio, r] : residuals) {
    const double n = static_cast<double>(r.tiles);
    double mean[2], var[2];
    for (int side = 0; side < 2; ++side) {
      mean[side] = r.sum[side] / n;
      var[side] = r.square[side] / n - mean[side] * mean[side];
    }
    const double corr = (r.product / n - mean[0] * mean[1]) / std::sqrt(var[0] * var[1]);
    std::string text[2];
    for (int side = 0; side < 2; ++side)
      for (int x = 0; x < kCountMax; ++x) {
        char cell[16];
        std::snprintf(cell, sizeof cell, "%s%.3f", x ? " " : "", r.hist[side][x] / n);
        text[side] += cell;
      }
    std::printf("| %gx | %lld | %.4f | %.4f | %.2f | %.2f | %.2f | %s | %s |\n", ratio, static_cast<long long>(r.tiles),
                mean[0] / 64, mean[1] / 64, var[0] / mean[0], var[1] / mean[1], corr, text[0].c_str(), text[1].c_str());
  }
  akv_context_destroy(ctx);
  return 0;
}
