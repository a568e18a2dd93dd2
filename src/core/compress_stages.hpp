// The stages of an AnchorKV compression as ANCHORKV_COMPRESS_PROFILE reports them, shared by
// both backends so that their profile lines read the same (docs/design.md §2.2).
#pragma once
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

namespace akv {

enum CompressStage : int {
  kStageSetup = 0,
  kStageLoad,
  kStageWindowAttention,
  kStageScores,
  kStageAnchorSelection,
  kStageAssignment,
  kStageUtilities,
  kStageResidualSelection,
  kStageEncoding,
  kStageCount
};

inline const char *stage_name(int stage) {
  static const char *const names[kStageCount] = {"setup",          "load",          "window attention",
                                                 "scores+pooling", "anchor selection", "assignment",
                                                 "utilities",      "residual selection", "encoding"};
  return stage >= 0 && stage < kStageCount ? names[stage] : "?";
}

// True when the environment variable `name` is set to something other than "" or "0" (the
// profiles' switches: ANCHORKV_COMPRESS_PROFILE here, ANCHORKV_DECODE_PROFILE in the CUDA decode).
inline bool env_switch(const char *name) {
  const char *value = std::getenv(name);
  return value && *value && *value != '0';
}
inline bool compress_profiling() { return env_switch("ANCHORKV_COMPRESS_PROFILE"); }

// The profile's one stderr line: "anchorkv <what> S=<S>: <stage> <ms> ms; ... total <ms> ms"
// and then `tail` (may be empty).
inline void print_stage_profile(const char *what, int64_t seq_len, const double (&ms)[kStageCount], const char *tail) {
  double total = 0.0;
  std::fprintf(stderr, "anchorkv %s S=%lld:", what, static_cast<long long>(seq_len));
  for (int i = 0; i < kStageCount; ++i) {
    std::fprintf(stderr, " %s %.3f ms;", stage_name(i), ms[i]);
    total += ms[i];
  }
  std::fprintf(stderr, " total %.3f ms%s\n", total, tail);
}

// Host wall clock per stage (the CPU backend): stage(id) closes the running stage and opens id;
// report() closes the last one and prints one stderr line in the CUDA profile's format.
class StageClock {
 public:
  StageClock() : on_(compress_profiling()), last_(now()) {}
  void stage(int id) {
    if (!on_) return;
    const double t = now();
    if (current_ >= 0) ms_[current_] += t - last_;
    current_ = id;
    last_ = t;
  }
  void report(const char *what, int64_t seq_len, const char *tail = "") {
    if (!on_) return;
    stage(-1);
    print_stage_profile(what, seq_len, ms_, tail);
  }

 private:
  static double now() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  bool on_;
  int current_ = -1;
  double last_;
  double ms_[kStageCount] = {};
};

}  // namespace akv
