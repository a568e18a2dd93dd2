// The head dims the CUDA kernels are instantiated for (64, 128, 256) and the one dispatch from
// a run-time head_dim to them, for the host code that picks a kernel template; likewise from a
// run-time flag to a template bool.
#pragma once
#include <type_traits>
#include "core/error.hpp"

namespace akv {
namespace cuda {

// Calls f(std::integral_constant<int, D>{}) for D = 64, 128 or 256 (the kernel's D is
// decltype(d)::value); AKV_ERR_UNSUPPORTED for any other head_dim.
template <typename F>
void with_head_dim(int head_dim, F &&f) {
  switch (head_dim) {
    case 64:
      f(std::integral_constant<int, 64>{});
      return;
    case 128:
      f(std::integral_constant<int, 128>{});
      return;
    case 256:
      f(std::integral_constant<int, 256>{});
      return;
    default:
      fail(AKV_ERR_UNSUPPORTED, "the CUDA kernels take head_dim 64, 128 or 256, not ", head_dim);
  }
}

// Calls f(std::bool_constant<flag>{}) (the kernel's bool is decltype(b)::value).
template <typename F>
void with_flag(bool flag, F &&f) {
  if (flag)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// The split kernel's path as its two flags, f(fast, gptj) (std::bool_constant each): the
// generic path, or the register-gather path with NeoX or GPT-J pairs (gptj implies fast; the
// generic path's kernel has no GPT-J variant).
template <typename F>
void with_split_path(bool fast, bool gptj, F &&f) {
  if (!fast)
    f(std::false_type{}, std::false_type{});
  else if (gptj)
    f(std::true_type{}, std::true_type{});
  else
    f(std::true_type{}, std::false_type{});
}

}  // namespace cuda
}  // namespace akv
