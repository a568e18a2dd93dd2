#include "methods.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "common.hpp"

namespace akvcli {

namespace {
std::string lower(std::string text) {
  for (char &c : text) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return text;
}

std::vector<std::string> split(const std::string &text, char separator) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, separator)) {
    part.erase(0, part.find_first_not_of(" \t"));
    part.erase(part.find_last_not_of(" \t") + 1);
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}
}  // namespace

std::vector<double> parse_ratios(const std::string &text) {
  std::vector<double> fractions;
  for (const std::string &part : split(text, ',')) {
    std::string body = part;
    if (!body.empty() && (body.back() == 'x' || body.back() == 'X')) body.pop_back();
    size_t used = 0;
    double value = 0;
    try {
      value = std::stod(body, &used);
    } catch (const std::exception &) {
      used = 0;
    }
    if (used == 0 || used != body.size() || !std::isfinite(value) || value <= 0.0)
      throw CliError("--ratios: \"" + part + "\" is not a positive number", kExitUsage);
    fractions.push_back(value > 1.0 ? 1.0 / value : value);
  }
  if (fractions.empty()) throw CliError("--ratios: no ratio given", kExitUsage);
  return fractions;
}

std::string ratio_label(double retain_fraction) {
  char buffer[32];
  std::snprintf(buffer, sizeof buffer, "%.3gx", 1.0 / retain_fraction);
  return buffer;
}

std::string method_names() {
  std::string names;
  for (const MethodEntry &entry : kMethods) {
    if (!names.empty()) names += ", ";
    names += entry.name;
  }
  return names;
}

std::string default_method_names() {
  std::string names;
  for (const MethodEntry &entry : kMethods) {
    if (!entry.on_by_default) continue;
    if (!names.empty()) names += ", ";
    names += entry.name;
  }
  return names;
}

std::vector<MethodRun> plan_methods(const std::string &methods, const std::vector<double> &fractions) {
  std::vector<const MethodEntry *> chosen;
  const std::string wanted = lower(methods);
  if (wanted.empty() || wanted == "default") {
    for (const MethodEntry &entry : kMethods)
      if (entry.on_by_default) chosen.push_back(&entry);
  } else if (wanted == "all") {
    for (const MethodEntry &entry : kMethods) chosen.push_back(&entry);
  } else {
    for (const std::string &name : split(wanted, ',')) {
      const MethodEntry *found = nullptr;
      for (const MethodEntry &entry : kMethods)
        if (lower(entry.name) == name) found = &entry;
      if (found == nullptr)
        throw CliError("--methods: unknown method \"" + name + "\" (known: " + method_names() + ")",
                       kExitUsage);
      if (std::find(chosen.begin(), chosen.end(), found) == chosen.end()) chosen.push_back(found);
    }
  }
  // FullKV first: it is the fidelity sanity check and the decode-time reference.
  const MethodEntry *fullkv = &kMethods[0];
  chosen.erase(std::remove(chosen.begin(), chosen.end(), fullkv), chosen.end());
  chosen.insert(chosen.begin(), fullkv);

  std::vector<MethodRun> runs;
  for (const MethodEntry *entry : chosen) {
    if (!entry->sweeps_ratios) {
      akv_compress_options defaults;
      akv_compress_options_init_method(&defaults, entry->method);
      runs.push_back({entry, entry->method == AKV_METHOD_FULLKV ? 1.0 : defaults.retain_fraction});
      continue;
    }
    for (double fraction : fractions) runs.push_back({entry, fraction});
  }
  return runs;
}

std::string MethodRun::target_label() const {
  if (entry->method == AKV_METHOD_FULLKV) return "1x";
  if (!entry->sweeps_ratios) return "-";
  return ratio_label(retain_fraction);
}

akv_compress_options method_options(const MethodRun &run, int window_queries, int layer_index,
                                    int layer_count) {
  akv_compress_options options;
  akv_compress_options_init_method(&options, run.entry->method);
  options.retain_fraction = run.retain_fraction;
  if (run.entry->uses_window_queries) options.window = std::min(options.window, window_queries);
  options.layer_index = layer_index;
  options.layer_count = layer_count;
  if (run.entry->configure != nullptr) run.entry->configure(&options);
  return options;
}

int widest_window(const std::vector<MethodRun> &runs) {
  int widest = 1;
  for (const MethodRun &run : runs) {
    if (!run.entry->uses_window_queries) continue;
    akv_compress_options defaults;
    akv_compress_options_init_method(&defaults, run.entry->method);
    widest = std::max(widest, static_cast<int>(defaults.window));
  }
  return widest;
}

}  // namespace akvcli
