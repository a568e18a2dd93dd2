// main() for the fuzz target without libFuzzer (any compiler; the sanitizer CI build and the
// ctest fuzz_corpus): replays files, checks that the seed corpus is still accepted (the
// format has not drifted from it), and runs seeded random mutations of the inputs.
//
//   anchorkv_fuzz_deserialize [--accepted DIR] [--runs N] [--seconds T] [--seed S] FILE|DIR...
//
//   FILE|DIR     inputs replayed once each and used as the mutation pool (directories: every
//                regular file in them)
//   --accepted   a directory of inputs akv_cache_deserialize must accept as they are (the seed
//                corpus); they join the pool
//   --runs N     mutated inputs to run (default 0); --seconds T: stop mutating after T s
//   --seed S     mutation seed (default 1): a finding is replayed with the same seed and runs
//
// Mutations are libFuzzer's kinds without its coverage feedback: bit flips, bytes, boundary
// integers and floats written over 1/2/4/8 bytes, small additions, truncation, erased,
// duplicated or inserted chunks, and splices of two inputs. A finding aborts (the target
// prints what, or a sanitizer reports); the input being run is then written to
// fuzz-finding.bin in the working directory (a SIGABRT handler and the sanitizers' death
// callback), ready to become a file of tests/fuzz/regressions/.
#include <anchorkv/anchorkv.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
// Present in the ASan/UBSan runtimes (gcc and clang); null without a sanitizer.
extern "C" void __sanitizer_set_death_callback(void (*callback)(void)) __attribute__((weak));

namespace {

// The input being run, for save_current_input() (async-signal-safe: open/write/close only).
const uint8_t *volatile current_data = nullptr;
volatile size_t current_size = 0;

void save_current_input() {
  const uint8_t *data = current_data;
  if (!data && current_size) return;
  const int fd = open("fuzz-finding.bin", O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  size_t done = 0;
  while (done < current_size) {
    const ssize_t n = write(fd, data + done, current_size - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  close(fd);
  static const char note[] = "fuzz: the input is in fuzz-finding.bin\n";
  (void)!write(2, note, sizeof note - 1);
}

void on_abort(int) {
  save_current_input();
  signal(SIGABRT, SIG_DFL);
  raise(SIGABRT);
}

void run(const uint8_t *data, size_t size) {
  current_data = data;
  current_size = size;
  LLVMFuzzerTestOneInput(data, size);
}

using Bytes = std::vector<uint8_t>;
namespace fs = std::filesystem;

struct Rng {
  uint64_t state;
  uint64_t next() {  // splitmix64
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  uint64_t below(uint64_t n) { return n ? next() % n : 0; }
};

Bytes read_file(const fs::path &path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

std::vector<fs::path> files_of(const fs::path &path) {
  std::vector<fs::path> out;
  if (fs::is_directory(path)) {
    for (const auto &entry : fs::directory_iterator(path))
      if (entry.is_regular_file()) out.push_back(entry.path());
  } else {
    out.push_back(path);
  }
  std::sort(out.begin(), out.end());
  return out;
}

const uint64_t kInteresting[] = {0,
                                 1,
                                 2,
                                 0x7f,
                                 0x80,
                                 0xff,
                                 0x7fff,
                                 0x8000,
                                 0xffff,
                                 0x7fffffff,
                                 0x80000000,
                                 0xffffffff,
                                 uint64_t{1} << 28,
                                 uint64_t{1} << 31,
                                 uint64_t{1} << 32,
                                 uint64_t{1} << 40,
                                 0x7fffffffffffffffull,
                                 0x8000000000000000ull,
                                 ~uint64_t{0},
                                 0x7fc00000,            // float NaN
                                 0x7f800000,            // float +Inf
                                 0xff800000,            // float -Inf
                                 0x7f80,                // bf16 +Inf
                                 0x7c00,                // f16 +Inf
                                 0x7ff8000000000000ull, // double NaN
                                 0x3ff0000000000000ull, // double 1.0
                                 0x4000000000000000ull};  // double 2.0

void mutate_once(Bytes &b, const std::vector<Bytes> &pool, Rng &rng) {
  const size_t n = b.size();
  switch (rng.below(n ? 9 : 1) + (n ? 0 : 7)) {
    case 0:  // flip a bit
      b[rng.below(n)] ^= static_cast<uint8_t>(1u << rng.below(8));
      break;
    case 1:  // a random byte
      b[rng.below(n)] = static_cast<uint8_t>(rng.next());
      break;
    case 2:
    case 3: {  // a boundary value over 1, 2, 4 or 8 bytes (often a field)
      const size_t width = size_t{1} << rng.below(4);
      if (n < width) break;
      uint64_t v = kInteresting[rng.below(sizeof kInteresting / sizeof kInteresting[0])];
      if (rng.below(4) == 0) v = ~v + 1;  // negated
      size_t at = rng.below(n - width + 1);
      if (rng.below(2)) at &= ~(width - 1);  // aligned like the format's fields, often
      std::memcpy(&b[at], &v, width);
      break;
    }
    case 4: {  // add a small delta to a little-endian integer
      const size_t width = size_t{1} << rng.below(4);
      if (n < width) break;
      const size_t at = rng.below(n - width + 1);
      uint64_t v = 0;
      std::memcpy(&v, &b[at], width);
      v += static_cast<uint64_t>(static_cast<int64_t>(rng.below(33)) - 16);
      std::memcpy(&b[at], &v, width);
      break;
    }
    case 5:  // truncate
      b.resize(rng.below(n + 1));
      break;
    case 6: {  // erase a chunk
      const size_t at = rng.below(n), len = 1 + rng.below(std::min<size_t>(n - at, 64));
      b.erase(b.begin() + static_cast<long>(at), b.begin() + static_cast<long>(at + len));
      break;
    }
    case 7: {  // insert random bytes or a copy of a chunk
      const size_t at = rng.below(n + 1), len = 1 + rng.below(64);
      Bytes chunk(len);
      if (n && rng.below(2)) {
        const size_t from = rng.below(n);
        for (size_t i = 0; i < len; ++i) chunk[i] = b[(from + i) % n];
      } else {
        for (uint8_t &c : chunk) c = static_cast<uint8_t>(rng.next());
      }
      b.insert(b.begin() + static_cast<long>(at), chunk.begin(), chunk.end());
      break;
    }
    default: {  // splice: a stretch of another input over the same offsets
      const Bytes &other = pool[rng.below(pool.size())];
      if (other.empty()) break;
      const size_t at = rng.below(std::min(n, other.size()));
      const size_t len = 1 + rng.below(std::min(n, other.size()) - at);
      std::memcpy(&b[at], &other[at], len);
      break;
    }
  }
}

int usage() {
  std::fprintf(stderr,
               "usage: anchorkv_fuzz_deserialize [--accepted DIR] [--runs N] [--seconds T] [--seed S] FILE|DIR...\n");
  return 2;
}

}  // namespace

int main(int argc, char **argv) {
  std::vector<fs::path> inputs, accepted;
  uint64_t runs = 0, seed = 1;
  double seconds = 0.0;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) std::exit(usage());
      return argv[++i];
    };
    if (arg == "--accepted") {
      for (const fs::path &p : files_of(value())) accepted.push_back(p);
    } else if (arg == "--runs") {
      runs = std::stoull(value());
    } else if (arg == "--seconds") {
      seconds = std::stod(value());
    } else if (arg == "--seed") {
      seed = std::stoull(value());
    } else if (!arg.empty() && arg[0] == '-') {
      return usage();
    } else {
      for (const fs::path &p : files_of(arg)) inputs.push_back(p);
    }
  }
  signal(SIGABRT, on_abort);
  if (__sanitizer_set_death_callback) __sanitizer_set_death_callback(save_current_input);
  const auto start = std::chrono::steady_clock::now();
  std::vector<Bytes> pool;
  // The seed corpus must still be accepted as it is: a format change must regenerate it
  // (tests/fuzz/make_corpus.cpp), or the fuzzer would only exercise the rejection paths.
  akv_context *context = nullptr;
  if (akv_context_create(nullptr, &context) != AKV_OK) return 1;
  int rejected = 0;
  for (const fs::path &path : accepted) {
    Bytes bytes = read_file(path);
    akv_cache *cache = nullptr;
    if (akv_cache_deserialize(context, bytes.data(), bytes.size(), &cache, nullptr) != AKV_OK) {
      std::fprintf(stderr, "seed %s is not accepted: %s\n", path.c_str(), akv_last_error_message());
      ++rejected;
    }
    akv_cache_destroy(cache);
    pool.push_back(std::move(bytes));
  }
  akv_context_destroy(context);
  if (rejected) {
    std::fprintf(stderr,
                 "%d of %zu seed inputs are not accepted: regenerate the corpus (tests/fuzz/README.md)\n",
                 rejected, accepted.size());
    return 1;
  }
  for (const fs::path &path : inputs) pool.push_back(read_file(path));
  for (const Bytes &bytes : pool) run(bytes.data(), bytes.size());
  const uint64_t replayed = pool.size();

  uint64_t mutated = 0;
  Rng rng{seed};
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  if (!pool.empty() && (runs > 0 || seconds > 0.0)) {
    for (; runs == 0 || mutated < runs; ++mutated) {
      if (seconds > 0.0 && (mutated & 63) == 0 && elapsed() >= seconds) break;
      Bytes input = pool[rng.below(pool.size())];
      const uint64_t rounds = 1 + rng.below(4);
      for (uint64_t r = 0; r < rounds; ++r) mutate_once(input, pool, rng);
      run(input.data(), input.size());
    }
  }
  std::printf("anchorkv_fuzz_deserialize: %llu inputs (%llu replayed, %zu seeds accepted as they are, %llu mutated, "
              "seed %llu) in %.1f s, no finding\n",
              static_cast<unsigned long long>(replayed + mutated), static_cast<unsigned long long>(replayed),
              accepted.size(), static_cast<unsigned long long>(mutated), static_cast<unsigned long long>(seed), elapsed());
  return 0;
}
