// The compression methods `anchorkv eval` and `anchorkv bench` compare.
//
// Every row starts from the method's paper defaults (akv_compress_options_init_method) and
// runs through the same akv_compress / akv_decode calls. FullKV is the reference: one row
// (target 1x), the decode-time column is relative to it. Methods that sweep ratios run at
// each --ratios value with retain_fraction = 1/ratio; Quantized runs once with its default
// bits (its ratio follows from them). Methods that score with window queries get the last
// `window` rows of the data's window queries, their default window capped to what the data
// hold.
// Adding a method to the default comparison is one line in kMethods (set on_by_default);
// `--methods NAME,...` picks any listed method, `--methods all` every one.
#pragma once

#include <string>
#include <vector>

#include "anchorkv/anchorkv.h"

namespace akvcli {

struct MethodEntry {
  const char *name;
  akv_method method;
  bool sweeps_ratios;        // false: one row at the method's own retain fraction
  bool uses_window_queries;  // false: prefill.queries = NULL, the method's window kept
  bool on_by_default;        // part of the comparison when --methods is not given
  // Method-specific option tweaks on top of the paper defaults; nullptr = none.
  void (*configure)(akv_compress_options *options);
};

inline const MethodEntry kMethods[] = {
    // name         method                  sweeps  queries  default  configure
    {"FullKV",      AKV_METHOD_FULLKV,      false,  false,   true,    nullptr},
    {"AnchorKV",    AKV_METHOD_ANCHORKV,    true,   true,    true,    nullptr},
    // AnchorKV's defaults in the paper's storage layout (format 2: u16 indices, bf16
    // coefficients, stored positions), to measure what storage format 3 changes.
    {"AnchorKV-f2", AKV_METHOD_ANCHORKV,    true,   true,    false,
     [](akv_compress_options *o) { o->storage_format = 2; }},
    // The AnchorKV paper's own settings (akv_compress_options_init_paper): no sink anchors,
    // k = max(W, S/128), no budget filling, rho 0.7 and a uniform sample, residual slots by
    // utility alone, the pooled score as it is, the paper's storage layout.
    {"AnchorKV-paper", AKV_METHOD_ANCHORKV, true,   true,    true,
     [](akv_compress_options *o) {
       akv_compress_options paper;
       akv_compress_options_init_paper(&paper);
       o->scored_fraction = paper.scored_fraction;
       o->sink_tokens = paper.sink_tokens;
       o->anchor_share = paper.anchor_share;
       o->fill_budget = paper.fill_budget;
       o->guard_fraction = paper.guard_fraction;
       o->coverage_rounds = paper.coverage_rounds;
       o->scored_min = paper.scored_min;
       o->follow_tokens = paper.follow_tokens;
       o->logit_correction = paper.logit_correction;
       o->storage_format = paper.storage_format;
     }},
    {"SnapKV",      AKV_METHOD_SNAPKV,      true,   true,    true,    nullptr},
    {"PyramidKV",   AKV_METHOD_PYRAMIDKV,   true,   true,    true,    nullptr},
    {"AdaKV",       AKV_METHOD_ADAKV,       true,   true,    true,    nullptr},
    {"AnDPro",      AKV_METHOD_ANDPRO,      true,   true,    true,    nullptr},
    // KVPress's presses as evictions at matched bytes (not in the default comparison).
    {"TOVA",        AKV_METHOD_TOVA,        true,   true,    false,   nullptr},
    {"Knorm",       AKV_METHOD_KNORM,       true,   false,   false,   nullptr},
    {"StreamingLLM", AKV_METHOD_STREAMINGLLM, true, false,   false,   nullptr},
    // TurboQuant as the paper measures it (3 bits + 4 outlier channels, "3.5 bits"), and at
    // 2 bits, the one width whose ratio reaches 5x (about 5.9x at D=128); no width reaches 10x.
    {"Quantized",   AKV_METHOD_QUANTIZED,   false,  false,   true,    nullptr},
    {"Quantized-2b", AKV_METHOD_QUANTIZED,  false,  false,   true,
     [](akv_compress_options *o) { o->quant_bits = 2; }},
};

// One row of a comparison: a method at one retain fraction.
struct MethodRun {
  const MethodEntry *entry;
  double retain_fraction;  // FullKV 1; Quantized: its default ceiling
  double target_ratio() const { return 1.0 / retain_fraction; }
  std::string target_label() const;  // "5x", FullKV "1x", "-" when the ratio follows from bits
};

// The options of a row: paper defaults, the row's retain fraction, layer index/count, and
// for methods that use window queries a window of at most `window_queries`.
akv_compress_options method_options(const MethodRun &run, int window_queries, int layer_index,
                                    int layer_count);
// Widest default window among the rows that use window queries (how many window queries
// the synthetic data should provide); at least 1.
int widest_window(const std::vector<MethodRun> &runs);

// Parses --methods ("" = defaults, "all", or comma-separated names, case-insensitive) and
// --ratios into the rows to run; FullKV always comes first (it is the reference).
std::vector<MethodRun> plan_methods(const std::string &methods, const std::vector<double> &fractions);
// --ratios "5,10,20" -> retain fractions 0.2, 0.1, 0.05. Values above 1 are compression
// ratios, values in (0, 1] retain fractions.
std::vector<double> parse_ratios(const std::string &text);
std::string ratio_label(double retain_fraction);  // "5x", "12.5x"
std::string method_names();                       // "FullKV, AnchorKV, ..." for --help
std::string default_method_names();               // the ones --methods default runs

}  // namespace akvcli
