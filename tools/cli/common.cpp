#include "common.hpp"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <exception>
#include <mutex>
#include <thread>

namespace akvcli {

std::string describe_status(akv_status status) {
  std::string text = akv_status_string(status);
  const char *detail = akv_last_error_message();
  if (detail != nullptr && detail[0] != '\0') {
    text += ": ";
    text += detail;
  }
  return text;
}

cxxopts::ParseResult parse_arguments(cxxopts::Options &options, int argc, char **argv, const std::string &help_hint) {
  try {
    return options.parse(argc, argv);
  } catch (const cxxopts::exceptions::exception &error) {
    throw CliError(std::string(error.what()) + " (see " + help_hint + ")", kExitUsage);
  }
}

void check(akv_status status, const std::string &what) {
  if (status != AKV_OK) throw CliError(what + " failed: " + describe_status(status), kExitFailure, status);
}

ContextHandle create_context(akv_backend backend, int num_threads, akv_status *status_out) {
  akv_context_options options;
  akv_context_options_init(&options);
  options.backend = backend;
  options.num_threads = num_threads;
  akv_context *raw = nullptr;
  const akv_status status = akv_context_create(&options, &raw);
  if (status_out != nullptr) *status_out = status;
  if (status == AKV_ERR_BACKEND_UNAVAILABLE) return ContextHandle();
  check(status, std::string("akv_context_create(") +
                    (backend == AKV_BACKEND_CUDA ? "CUDA" : "CPU") + ")");
  return ContextHandle(raw);
}

// ---- RNG ------------------------------------------------------------------------------------

namespace {
uint64_t splitmix64(uint64_t &state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
}  // namespace

Rng::Rng(uint64_t seed) {
  uint64_t state = seed;
  for (auto &word : s_) word = splitmix64(state);
}

Rng Rng::keyed(uint64_t seed, uint64_t a, uint64_t b, uint64_t c) {
  uint64_t state = seed;
  uint64_t mixed = splitmix64(state);
  for (uint64_t part : {a, b, c}) {
    state = mixed ^ (part * 0xd1342543de82ef95ull + 0x2545f4914f6cdd1dull);
    mixed = splitmix64(state);
  }
  return Rng(mixed);
}

uint64_t Rng::next_u64() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next_u64() >> 11) * 0x1.0p-53; }

double Rng::normal() {
  if (have_spare_) {
    have_spare_ = false;
    return spare_;
  }
  // Marsaglia's polar method: no trigonometry.
  double u, v, s;
  do {
    u = 2.0 * uniform() - 1.0;
    v = 2.0 * uniform() - 1.0;
    s = u * u + v * v;
  } while (s >= 1.0 || s == 0.0);
  const double factor = std::sqrt(-2.0 * std::log(s) / s);
  spare_ = v * factor;
  have_spare_ = true;
  return u * factor;
}

int64_t Rng::below(int64_t n) {
  if (n <= 1) return 0;
  return static_cast<int64_t>(uniform() * static_cast<double>(n)) % n;
}

// ---- Scalar formats ---------------------------------------------------------------------------

uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float bf16_to_float(uint16_t bits16) {
  const uint32_t bits = static_cast<uint32_t>(bits16) << 16;
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

uint16_t float_to_f16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  // rounds to or beyond Inf
  if (magnitude < 0x38800000u) {                       // subnormal or zero
    float scaled;
    std::memcpy(&scaled, &magnitude, 4);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(scaled * 16777216.0f)));
  }
  uint32_t rebased = magnitude - 0x38000000u;
  rebased += 0xfffu + ((rebased >> 13) & 1u);
  return static_cast<uint16_t>(sign | (rebased >> 13));
}

float f16_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  uint32_t exponent = (half >> 10) & 0x1fu;
  uint32_t mantissa = half & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {
      exponent = 127 - 15 + 1;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        --exponent;
      }
      bits = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else {
    bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
  }
  float value;
  std::memcpy(&value, &bits, 4);
  return value;
}

size_t dtype_bytes(akv_dtype dtype) {
  switch (dtype) {
    case AKV_DTYPE_F32: return 4;
    case AKV_DTYPE_F16:
    case AKV_DTYPE_BF16: return 2;
    default: return 0;
  }
}

const char *dtype_label(akv_dtype dtype) {
  switch (dtype) {
    case AKV_DTYPE_F32: return "f32";
    case AKV_DTYPE_F16: return "f16";
    case AKV_DTYPE_BF16: return "bf16";
    default: return "auto";
  }
}

void round_to_dtype(std::vector<float> &values, akv_dtype dtype) {
  if (dtype == AKV_DTYPE_F16) {
    for (float &v : values) v = f16_to_float(float_to_f16(v));
  } else if (dtype == AKV_DTYPE_BF16) {
    for (float &v : values) v = bf16_to_float(float_to_bf16(v));
  }
}

std::vector<uint8_t> encode_dtype(const std::vector<float> &values, akv_dtype dtype) {
  std::vector<uint8_t> bytes(values.size() * dtype_bytes(dtype));
  if (dtype == AKV_DTYPE_F32) {
    std::memcpy(bytes.data(), values.data(), bytes.size());
  } else {
    auto *out = reinterpret_cast<uint16_t *>(bytes.data());
    for (size_t i = 0; i < values.size(); ++i)
      out[i] = dtype == AKV_DTYPE_F16 ? float_to_f16(values[i]) : float_to_bf16(values[i]);
  }
  return bytes;
}

// ---- Threads ------------------------------------------------------------------------------------

int resolve_threads(int threads) {
  if (threads > 0) return threads;
  const unsigned hardware = std::thread::hardware_concurrency();
  return hardware == 0 ? 1 : static_cast<int>(hardware);
}

void parallel_for(int64_t n, int threads, const std::function<void(int64_t)> &fn) {
  const int workers = static_cast<int>(std::min<int64_t>(resolve_threads(threads), n));
  if (workers <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  std::exception_ptr first_error;
  std::mutex error_mutex;
  auto worker = [&]() {
    for (;;) {
      const int64_t i = next.fetch_add(1);
      if (i >= n) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!first_error) first_error = std::current_exception();
        next.store(n);  // stop handing out work
      }
    }
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) pool.emplace_back(worker);
  worker();
  for (auto &thread : pool) thread.join();
  if (first_error) std::rethrow_exception(first_error);
}

// ---- Statistics --------------------------------------------------------------------------------

double percentile(std::vector<double> values, double fraction) {
  if (values.empty()) return std::nan("");
  std::sort(values.begin(), values.end());
  const double position = fraction * static_cast<double>(values.size() - 1);
  const size_t lower = static_cast<size_t>(std::floor(position));
  const size_t upper = std::min(lower + 1, values.size() - 1);
  const double weight = position - static_cast<double>(lower);
  return values[lower] * (1.0 - weight) + values[upper] * weight;
}

double median(std::vector<double> values) { return percentile(std::move(values), 0.5); }

double cosine(const double *a, const double *b, int n) {
  const double ab = dot(a, b, n), aa = dot(a, a, n), bb = dot(b, b, n);
  if (aa <= 0.0 && bb <= 0.0) return 1.0;  // both zero: identical
  if (aa <= 0.0 || bb <= 0.0) return 0.0;
  return ab / std::sqrt(aa * bb);
}

double cosine(const float *a, const double *b, int n) {
  std::vector<double> widened(a, a + n);
  return cosine(widened.data(), b, n);
}

std::string format_seconds(double seconds) {
  char buffer[64];
  if (!std::isfinite(seconds)) return "-";
  if (seconds < 1e-3)
    std::snprintf(buffer, sizeof buffer, "%.0f us", seconds * 1e6);
  else if (seconds < 1.0)
    std::snprintf(buffer, sizeof buffer, "%.3g ms", seconds * 1e3);
  else
    std::snprintf(buffer, sizeof buffer, "%.3g s", seconds);
  return buffer;
}

std::string format_fixed(double value, int decimals) {
  if (!std::isfinite(value)) return "-";
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", decimals, value);
  return buffer;
}

}  // namespace akvcli
