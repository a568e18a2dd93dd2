#include "rope.hpp"

#include <cmath>
#include <sstream>

#include "common.hpp"

namespace akvcli {

akv_rope RopeConfig::to_library() const {
  akv_rope rope{};
  rope.style = style;
  rope.rotary_dim = rotary_dim;
  rope.base = base;
  rope.inv_freq = inv_freq.empty() ? nullptr : inv_freq.data();
  return rope;
}

std::string RopeConfig::describe(int head_dim) const {
  std::ostringstream text;
  switch (style) {
    case AKV_ROPE_NONE: return "none";
    case AKV_ROPE_NEOX: text << "neox"; break;
    case AKV_ROPE_GPTJ: text << "gptj"; break;
  }
  text << " rotary_dim=" << (rotary_dim == 0 ? head_dim : rotary_dim);
  if (inv_freq.empty())
    text << " base=" << base;
  else
    text << " inv_freq=table";
  return text.str();
}

Rotary::Rotary(const RopeConfig &config, int head_dim) {
  if (config.style == AKV_ROPE_NONE) return;
  const int rotary_dim = config.rotary_dim == 0 ? head_dim : config.rotary_dim;
  if (rotary_dim <= 0 || rotary_dim > head_dim || rotary_dim % 2 != 0)
    throw CliError("rotary_dim " + std::to_string(rotary_dim) +
                   " must be even and within (0, head_dim=" + std::to_string(head_dim) + "]");
  const int half = rotary_dim / 2;
  if (!config.inv_freq.empty() && static_cast<int>(config.inv_freq.size()) != half)
    throw CliError("inv_freq has " + std::to_string(config.inv_freq.size()) +
                   " entries, rotary_dim/2 = " + std::to_string(half) + " expected");
  for (int i = 0; i < half; ++i) {
    // fp32 frequencies, as models store them and as the library computes them.
    const float frequency = config.inv_freq.empty()
                                ? static_cast<float>(std::pow(config.base, -2.0 * i / rotary_dim))
                                : config.inv_freq[i];
    inv_freq_.push_back(static_cast<double>(frequency));
    if (config.style == AKV_ROPE_NEOX) {
      first_.push_back(i);
      second_.push_back(i + half);
    } else {
      first_.push_back(2 * i);
      second_.push_back(2 * i + 1);
    }
  }
}

namespace {
template <typename T>
void rotate(T *x, double position, bool inverse, const std::vector<int> &first,
            const std::vector<int> &second, const std::vector<double> &inv_freq) {
  for (size_t j = 0; j < first.size(); ++j) {
    const double angle = position * inv_freq[j];
    const double c = std::cos(angle);
    const double s = inverse ? -std::sin(angle) : std::sin(angle);
    const double a = x[first[j]], b = x[second[j]];
    x[first[j]] = static_cast<T>(a * c - b * s);
    x[second[j]] = static_cast<T>(a * s + b * c);
  }
}
}  // namespace

void Rotary::apply(double *x, double position, bool inverse) const {
  rotate(x, position, inverse, first_, second_, inv_freq_);
}
void Rotary::apply(float *x, double position, bool inverse) const {
  rotate(x, position, inverse, first_, second_, inv_freq_);
}

RotaryTable::RotaryTable(const Rotary &rotary, int64_t first_position, int64_t count) : rotary_(rotary) {
  const int pairs = rotary.pairs();
  cos_.resize(static_cast<size_t>(count) * pairs);
  sin_.resize(cos_.size());
  for (int64_t t = 0; t < count; ++t)
    for (int j = 0; j < pairs; ++j) {
      const double angle = static_cast<double>(first_position + t) * rotary.inv_freq()[j];
      cos_[t * pairs + j] = std::cos(angle);
      sin_[t * pairs + j] = std::sin(angle);
    }
}

void RotaryTable::apply(double *x, int64_t index) const {
  const int pairs = rotary_.pairs();
  const double *c = &cos_[static_cast<size_t>(index) * pairs];
  const double *s = &sin_[static_cast<size_t>(index) * pairs];
  const std::vector<int> &first = rotary_.first(), &second = rotary_.second();
  for (int j = 0; j < pairs; ++j) {
    const double a = x[first[j]], b = x[second[j]];
    x[first[j]] = a * c[j] - b * s[j];
    x[second[j]] = a * s[j] + b * c[j];
  }
}

}  // namespace akvcli
