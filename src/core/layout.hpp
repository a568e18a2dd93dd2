// Byte accounting and storage layout (paper Eq. 9 and 13, App. A.1 Table 1, docs/design.md §3).
// Everything here depends only on the shape and the options, never on the data, so the exact
// size of a cache is known before compression.
#pragma once
#include <array>
#include <cstdint>
#include "anchorkv/anchorkv.h"
#include "core/codec.hpp"
#include "core/dtype.hpp"

namespace akv {

constexpr uint64_t kSectionAlignment = 64;

// The arrays of an AnchorKV cache, in storage order. Per head unless noted. Format 2 is the
// paper's layout; format 3 (docs/design.md §3.7) reaches anchors through a table per segment of
// positions and stores positions implicitly. A section a format does not use has 0 bytes.
enum AnchorSection : int {
  kAnchorKeys = 0,      // [H][k][D] storage dtype, pre-RoPE
  kAnchorValues,        // [H][k][D]
  kAnchorTokens,        // [H][k-W] int64: token index of each non-window anchor
  kKeyIndex,            // [H][P] format 2: u16 anchor index; 3: u8 entry of the segment's table
  kValueIndex,          // [H][P] the same for values
  kKeyGamma,            // [H][P] format 2: bf16 coefficient; 3: u8 code (gamma_code)
  kValueGamma,          // [H][P]
  kPositions,           // [P] int32, shared by heads and sides (format 2; 3: implicit)
  kKeyMask,             // [H][words] u64 residual bitmask
  kValueMask,           // [H][words] u64
  kKeyPrefix,           // [H][words] u32 residuals before each word, within the head
  kValuePrefix,         // [H][words] u32
  kKeyOffsets,          // [H+1] u32 first residual slot of each head
  kValueOffsets,        // [H+1] u32
  kKeyCodes,            // [N_K][D'/4] u8, 2-bit codes (D' = D padded to a power of two)
  kKeyScales,           // [N_K] f32
  kValueCodes,          // [N_V][D'/4] u8
  kValueScales,         // [N_V] f32
  kValueChunkPos,       // [N_V] u8 position of the residual inside its 64-token word
  kSegmentTables,       // format 3, k > 256: [H][segments][256] u16 anchor of each table entry
  kGammaScales,         // format 3: [H][segments][2] f32, the keys' then the values' code scale
  kAnchorSectionCount
};

struct Section {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

// Format 3's candidate reach in anchors: with a segment's own (at most about 64,
// segment_length()) and the window's, the candidates fit in one table. On synthetic data 64
// and 112 gave the same fidelity (docs/design.md §2.2 step 5).
constexpr int64_t kReachAnchors = 64;

// Derived sizes of one AnchorKV layer.
struct AnchorGeometry {
  int64_t seq_len = 0;      // S
  int64_t prefix = 0;       // P = S - W
  int32_t heads = 0;        // H
  int32_t q_heads = 0;      // Hq
  int32_t dim = 0;          // D
  int32_t window = 0;       // W
  int32_t anchors = 0;      // k (incl. window)
  int32_t pool_heads = 0;   // heads per residual-pooling group (a divisor of H; H = one group)
  int64_t words = 0;        // ceil(P / 64)
  int32_t format = 2;       // storage format, 2 or 3
  int64_t segment_len = 0;  // format 3: positions per segment (a power of two)
  int32_t segment_shift = 0;  // log2(segment_len)
  int64_t segments = 0;     // format 3: ceil(P / segment_len)
  int32_t table_size = 0;   // format 3: entries per segment table; 0 = none (k <= 256: the
                            // one-byte index is the anchor itself)
  int64_t key_residuals = 0;    // N_K
  int64_t value_residuals = 0;  // N_V
  uint64_t full_bytes = 0;      // M_full
  uint64_t budget_bytes = 0;    // floor(theta * M_full)
  uint64_t base_bytes = 0;      // M_base
  uint64_t footprint = 0;       // M_base + N_K c_K + N_V c_V
  // D' = dim padded to a power of two (the codec's rotation; D' = D for 64, 128, 256).
  int64_t code_bytes() const { return padded_dim(dim) / 4; }          // D'/4
  int64_t key_residual_bytes() const { return code_bytes() + 4; }     // c_K
  int64_t value_residual_bytes() const { return code_bytes() + 5; }   // c_V
  int32_t group() const { return q_heads / heads; }
  int64_t segment_of(int64_t t) const { return t >> segment_shift; }
  // Format 3's local candidates (docs/design.md §2.2 step 5): a segment's tokens may use the
  // anchors within this many positions of it (kReachAnchors anchors' worth at the layer's
  // mean density), besides the window; -1 without tables (every anchor is a candidate).
  int64_t candidate_reach() const;
  int32_t pool_groups() const { return heads / pool_heads; }
};

// Validates the shape and options for AnchorKV and computes the accounting. Throws
// AKV_ERR_BUDGET naming the smallest workable retain_fraction when M_base does not fit.
AnchorGeometry anchor_geometry(const akv_compress_options &options, const akv_shape &shape);

// Exact per-array sizes and 64-byte aligned offsets inside one allocation.
struct AnchorLayout {
  std::array<Section, kAnchorSectionCount> sections{};
  uint64_t total_bytes = 0;  // allocation size: footprint plus alignment padding
};
AnchorLayout anchor_layout(const AnchorGeometry &g);

// Format 3 (docs/design.md §3.2).
constexpr int32_t kTableEntries = 256;  // one-byte indices
// Positions per segment for P prefix tokens and k anchors: the table of 256 entries holds the
// anchors that a segment's tokens use most; a segment holds about 64 anchors' worth of tokens
// (segment_len * k / P <= 64), 256 to 4096 positions. With k <= 256 there are no tables and
// segments only scope the coefficient scales (1024 positions).
int64_t segment_length(int64_t prefix, int64_t anchors);
// Coefficients as one byte: gamma_code (core/codebook.hpp), scale being the largest |gamma| of
// the segment's side (m 0 of the positive sign is not used: code 0 means 0).
// The value of every code for scale 1. A code's coefficient is scale * unit rounded to bf16,
// so that it widens exactly to format 2's bf16 coefficient (the CUDA decode computes it the
// same way from CacheView::gamma_units).
const float *gamma_units();
inline float gamma_value(uint8_t code, float scale) { return bf16_to_float(float_to_bf16(scale * gamma_units()[code])); }
// gamma_value of every code for one scale: out[256].
inline void gamma_values(float scale, float *out) {
  for (int c = 0; c < 256; ++c) out[c] = gamma_value(static_cast<uint8_t>(c), scale);
}

// The paper's anchor count k = max(W, S/128), clamped to S and to 65536 (u16 anchor indices);
// anchor_geometry raises it by anchor_share and fill_budget.
int64_t default_anchor_count(int64_t seq_len, int32_t window);

// Anchor selection shares of one head, the same on every backend: the sink anchors (the first
// positions, min(sink_tokens, k-W, P)) and the scored share of the k-W free slots
// (scored_share), raised to hold the sinks, which rank first in it.
int64_t sink_anchor_count(const akv_compress_options &options, const AnchorGeometry &g);
int64_t scored_anchor_count(const akv_compress_options &options, const AnchorGeometry &g);
// Of `slots` anchor slots, how many go by score: round(rho * slots), at least scored_min,
// at most slots (prefill: the k-W free slots; compaction: the appended tokens' slots).
int64_t scored_share(const akv_compress_options &options, int64_t slots);

// How one side's n residual slots are chosen: by_utility by Eq. 6, then by_energy (the
// guard_fraction share) by residual energy among the tokens left.
struct ResidualSplit {
  int64_t by_utility = 0;
  int64_t by_energy = 0;
};
ResidualSplit residual_split(const akv_compress_options &options, int64_t n);

// Smallest retain_fraction whose budget holds the base bytes, rounded up to 6 decimals.
double minimum_retain_fraction(uint64_t base_bytes, uint64_t full_bytes);

}  // namespace akv
