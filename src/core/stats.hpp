// What akv_cache_stats_get and akv_cache_head_stats report, from a cache's host-side parts.
#pragma once
#include <cstdint>
#include "anchorkv/anchorkv.h"
#include "core/context.hpp"

namespace akv {

// Every field, struct_size = sizeof(akv_cache_stats) (the shim copies the caller's prefix).
akv_cache_stats cache_stats(const akv_cache &cache);
// out[H]; offsets: AnchorKV's key then value residual offsets [H+1] each, as host copies
// (null for other methods).
void head_stats(const akv_cache &cache, const uint32_t *offsets, akv_head_stats *out);

}  // namespace akv
