// The defaults and value ranges of akv_compress_options in one place (an option's default and
// its range sit side by side in options.cpp). The ranges are one rule for the two places that
// read options: akv_compress and friends (bad input, AKV_ERR_INVALID_ARGUMENT) and the
// deserializer of a format-2 cache, which stores the options a compaction reuses
// (AKV_ERR_CORRUPT_DATA).
#pragma once
#include "anchorkv/anchorkv.h"

namespace akv {

// What akv_compress_options_init, akv_compress_options_init_paper and
// akv_compress_options_init_method give (struct_size set).
akv_compress_options default_options();
akv_compress_options paper_options();
akv_compress_options method_options(akv_method method);
// What akv_prefill_init gives: zeros, struct_size, bf16.
akv_prefill default_prefill();

// Fails with `status` and "<prefix><field> <value> must be ..." at the first numeric field
// outside its range (enums are the caller's: the API checks them as raw integers). Fields a
// method reads only for itself (adakv_alpha, pyramid_beta, andpro_chunk, quant_*) are checked
// where that method plans its budget.
void check_option_ranges(const akv_compress_options &o, akv_status status, const char *prefix);

}  // namespace akv
