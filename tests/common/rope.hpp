// Rotary position embedding reference in double precision (NeoX rotate-half and GPT-J
// interleaved, partial rotary dim, base or explicit inverse-frequency table).
#pragma once

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

namespace akv_test {

enum class RopeStyle { None, NeoX, GptJ };

struct RopeReference {
  RopeStyle style = RopeStyle::NeoX;
  int rotary_dim = 0;            // 0 = head_dim
  double base = 10000.0;
  std::vector<double> inv_freq;  // optional, rotary_dim/2 entries; overrides base

  int effective_rotary_dim(int head_dim) const { return rotary_dim == 0 ? head_dim : rotary_dim; }

  std::vector<double> frequencies(int head_dim) const {
    const int rotary = effective_rotary_dim(head_dim);
    if (!inv_freq.empty()) {
      if (static_cast<int>(inv_freq.size()) != rotary / 2)
        throw std::invalid_argument("inv_freq must have rotary_dim/2 entries");
      return inv_freq;
    }
    std::vector<double> freq(static_cast<size_t>(rotary / 2));
    for (int i = 0; i < rotary / 2; ++i) freq[i] = std::pow(base, -2.0 * i / rotary);
    return freq;
  }

  // Rotates one row in place by angle position*freq (direction -1 undoes the rotation).
  void rotate_row(double *row, int head_dim, double position, const std::vector<double> &freq,
                  int direction = 1) const {
    if (style == RopeStyle::None) return;
    const int rotary = effective_rotary_dim(head_dim);
    const int half = rotary / 2;
    for (int i = 0; i < half; ++i) {
      const double angle = direction * position * freq[i];
      const double c = std::cos(angle), s = std::sin(angle);
      const int first = style == RopeStyle::NeoX ? i : 2 * i;
      const int second = style == RopeStyle::NeoX ? i + half : 2 * i + 1;
      const double x = row[first], y = row[second];
      row[first] = x * c - y * s;
      row[second] = y * c + x * s;
    }
  }

  // x: [heads][tokens][head_dim]; positions: [tokens]. Returns the rotated copy.
  template <typename T>
  std::vector<double> apply(const std::vector<T> &x, int heads, int64_t tokens, int head_dim,
                            const std::vector<int32_t> &positions, int direction = 1) const {
    if (static_cast<int64_t>(positions.size()) != tokens)
      throw std::invalid_argument("positions must have one entry per token");
    const std::vector<double> freq = style == RopeStyle::None ? std::vector<double>{}
                                                              : frequencies(head_dim);
    std::vector<double> out(x.begin(), x.end());
    for (int h = 0; h < heads; ++h)
      for (int64_t t = 0; t < tokens; ++t)
        rotate_row(&out[(static_cast<size_t>(h) * tokens + t) * head_dim], head_dim,
                   positions[static_cast<size_t>(t)], freq, direction);
    return out;
  }
};

inline std::vector<int32_t> default_positions(int64_t count, int32_t start = 0) {
  std::vector<int32_t> positions(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) positions[static_cast<size_t>(i)] = start + static_cast<int32_t>(i);
  return positions;
}

}  // namespace akv_test
