// Shared helpers of the anchorkv command-line tool: error handling around the C API, RAII
// handles, timing, a small deterministic RNG, scalar format conversions, a parallel loop and
// order statistics. Only the public C API of the library is used.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <cxxopts.hpp>

#include "anchorkv/anchorkv.h"

namespace akvcli {

// Exit codes of the tool.
constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;   // library error, unreadable or malformed input
constexpr int kExitUsage = 2;     // bad command line
constexpr int kExitCheck = 3;     // eval --check: a self-check failed

// An error the tool reports as "anchorkv: error: <message>" before exiting with `exit_code`.
class CliError : public std::runtime_error {
 public:
  explicit CliError(const std::string &message, int exit_code = kExitFailure, akv_status status = AKV_OK)
      : std::runtime_error(message), exit_code_(exit_code), status_(status) {}
  int exit_code() const { return exit_code_; }
  // The library status behind the error (AKV_OK when it came from the tool itself).
  akv_status status() const { return status_; }

 private:
  int exit_code_;
  akv_status status_;
};

// Text of a failed call: status name plus the library's thread-local detail.
std::string describe_status(akv_status status);
// Parses a subcommand's arguments; a parse error becomes a usage CliError that points at
// `help_hint` (e.g. "anchorkv bench --help").
cxxopts::ParseResult parse_arguments(cxxopts::Options &options, int argc, char **argv, const std::string &help_hint);

// Throws CliError("<what>: <status>: <detail>") unless status is AKV_OK.
void check(akv_status status, const std::string &what);

struct ContextDeleter {
  void operator()(akv_context *context) const { akv_context_destroy(context); }
};
struct CacheDeleter {
  void operator()(akv_cache *cache) const { akv_cache_destroy(cache); }
};
using ContextHandle = std::unique_ptr<akv_context, ContextDeleter>;
using CacheHandle = std::unique_ptr<akv_cache, CacheDeleter>;

// Creates a context; returns an empty handle (and sets *status) when the backend is
// unavailable so callers can skip it; throws on any other failure.
ContextHandle create_context(akv_backend backend, int num_threads, akv_status *status = nullptr);

class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// xoshiro256** seeded through splitmix64: fast, deterministic on every platform (the
// standard library's distributions are not), so a seed always gives the same data.
class Rng {
 public:
  explicit Rng(uint64_t seed);
  // Independent stream for a (seed, a, b, c) key, e.g. (seed, layer, head, purpose).
  static Rng keyed(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0);
  uint64_t next_u64();
  double uniform();                 // [0, 1)
  double normal();                  // N(0, 1), polar method with a cached second value
  int64_t below(int64_t n);         // uniform integer in [0, n)

 private:
  uint64_t s_[4];
  bool have_spare_ = false;
  double spare_ = 0.0;
};

// Scalar formats (round to nearest even).
uint16_t float_to_bf16(float value);
float bf16_to_float(uint16_t bits);
uint16_t float_to_f16(float value);
float f16_to_float(uint16_t bits);
size_t dtype_bytes(akv_dtype dtype);
const char *dtype_label(akv_dtype dtype);
// Rounds every value to what `dtype` can hold (no-op for F32).
void round_to_dtype(std::vector<float> &values, akv_dtype dtype);
// Packs floats into `dtype` bytes (F32, F16 or BF16).
std::vector<uint8_t> encode_dtype(const std::vector<float> &values, akv_dtype dtype);

// Runs fn(i) for i in [0, n) on up to `threads` threads (0 = hardware threads). The first
// exception thrown by a task is rethrown after all threads stop.
void parallel_for(int64_t n, int threads, const std::function<void(int64_t)> &fn);
int resolve_threads(int threads);

// Order statistics of a copy of `values` (linear interpolation between order statistics).
double percentile(std::vector<double> values, double fraction);
double median(std::vector<double> values);

// Dot product and norm in double with independent accumulators (vectorizes).
inline double dot(const double *a, const double *b, int n) {
  double acc0 = 0, acc1 = 0, acc2 = 0, acc3 = 0;
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    acc0 += a[i] * b[i];
    acc1 += a[i + 1] * b[i + 1];
    acc2 += a[i + 2] * b[i + 2];
    acc3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) acc0 += a[i] * b[i];
  return (acc0 + acc1) + (acc2 + acc3);
}
double cosine(const double *a, const double *b, int n);
double cosine(const float *a, const double *b, int n);

// Human-readable helpers.
std::string format_seconds(double seconds);  // "812 us", "12.3 ms", "2.41 s"
std::string format_fixed(double value, int decimals);

}  // namespace akvcli
