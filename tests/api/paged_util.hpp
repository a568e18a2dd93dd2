// A prefill's keys and values laid out in an engine's paged cache (vLLM [block][token][head]
// [dim], or head-major blocks [block][head][token][dim] as FlashInfer's HND), in blocks drawn
// at random from a larger pool whose other blocks hold NaN: reading a wrong block fails.
#pragma once

#include <numeric>

#include "api/api_test_util.hpp"

namespace akv_test {

struct PagedKV {
  int32_t block_size = 0, num_blocks = 0;
  bool head_major = false;  // [block][head][token][dim] instead of vLLM's [block][token][head][dim]
  std::vector<int32_t> table;
  std::vector<uint8_t> keys, values;

  // `base` with the keys and values replaced by this paged copy.
  akv_prefill view(const PrefillData &data) const {
    akv_prefill p = data.view();
    p.keys = keys.data();
    p.values = values.data();
    p.block_table = table.data();
    p.block_size = block_size;
    p.num_blocks = num_blocks;
    if (head_major) {  // explicit strides; vLLM's are the defaults
      p.kv_token_stride = data.head_dim();
      p.kv_head_stride = int64_t{block_size} * data.head_dim();
      p.kv_block_stride = p.kv_head_stride * data.kv_heads();
    }
    return p;
  }
};

inline PagedKV make_paged(Rng &rng, const PrefillData &data, int32_t block_size, bool head_major, int spare_blocks = 5) {
  PagedKV paged;
  paged.block_size = block_size;
  paged.head_major = head_major;
  const int64_t S = data.seq_len(), H = data.kv_heads(), D = data.head_dim();
  const int64_t used = (S + block_size - 1) / block_size;
  paged.num_blocks = static_cast<int32_t>(used + spare_blocks);
  std::vector<int32_t> ids(paged.num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  for (int64_t i = paged.num_blocks - 1; i > 0; --i) std::swap(ids[i], ids[rng.uniform_int(0, i)]);
  paged.table.assign(ids.begin(), ids.begin() + used);
  const size_t esize = dtype_size(data.dtype);
  const std::vector<uint8_t> nan = encode({std::numeric_limits<float>::quiet_NaN()}, data.dtype);
  const size_t elements = static_cast<size_t>(paged.num_blocks) * block_size * H * D;
  for (std::vector<uint8_t> *dst : {&paged.keys, &paged.values}) {
    dst->resize(elements * esize);
    for (size_t e = 0; e < elements; ++e) std::memcpy(dst->data() + e * esize, nan.data(), esize);
  }
  for (int64_t t = 0; t < S; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const int64_t block = paged.table[t / block_size], row = t % block_size;
      const int64_t at = head_major ? ((block * H + h) * block_size + row) * D : ((block * block_size + row) * H + h) * D;
      const size_t from = static_cast<size_t>((h * S + t) * D) * esize;
      std::memcpy(paged.keys.data() + at * esize, data.keys.bytes.data() + from, D * esize);
      std::memcpy(paged.values.data() + at * esize, data.values.bytes.data() + from, D * esize);
    }
  return paged;
}

}  // namespace akv_test
