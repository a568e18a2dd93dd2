// The compression methods `anchorkv eval` and `anchorkv bench` compare.
//
// FullKV is the reference: it runs once (target ratio 1x) and the decode-time column is
// relative to it. Every other method runs at each --ratios value with
// retain_fraction = 1/ratio, through the same akv_compress / akv_decode calls.
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
  bool sweeps_ratios;  // false: one row at retain_fraction 1 (FullKV)
  bool on_by_default;  // part of the comparison when --methods is not given
  // Method-specific option tweaks on top of the shared ones; nullptr = library defaults.
  void (*configure)(akv_compress_options *options);
};

inline const MethodEntry kMethods[] = {
    // name         method                  sweeps  default  configure
    {"FullKV",      AKV_METHOD_FULLKV,      false,  true,    nullptr},
    {"AnchorKV",    AKV_METHOD_ANCHORKV,    true,   true,    nullptr},
    {"SnapKV",      AKV_METHOD_SNAPKV,      true,   false,   nullptr},
    {"PyramidKV",   AKV_METHOD_PYRAMIDKV,   true,   false,   nullptr},
    {"AdaKV",       AKV_METHOD_ADAKV,       true,   false,   nullptr},
    {"AnDPro",      AKV_METHOD_ANDPRO,      true,   false,   nullptr},
    {"Quantized",   AKV_METHOD_QUANTIZED,   true,   false,   nullptr},
};

// One row of a comparison: a method at one retain fraction.
struct MethodRun {
  const MethodEntry *entry;
  double retain_fraction;  // 1 for FullKV
  double target_ratio() const { return 1.0 / retain_fraction; }
};

// Parses --methods ("" = defaults, "all", or comma-separated names, case-insensitive) and
// --ratios into the rows to run; FullKV always comes first (it is the reference).
std::vector<MethodRun> plan_methods(const std::string &methods, const std::vector<double> &fractions);
// --ratios "5,10,20" -> retain fractions 0.2, 0.1, 0.05. Values above 1 are compression
// ratios, values in (0, 1] retain fractions.
std::vector<double> parse_ratios(const std::string &text);
std::string ratio_label(double retain_fraction);  // "5x", "12.5x"
std::string method_names();                       // "FullKV, AnchorKV, ..." for --help

}  // namespace akvcli
