// Argument checks shared by the C shims: every one fails with a status and a message that
// names the argument, before anything is modified.
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include "anchorkv/anchorkv.h"
#include "core/context.hpp"
#include "core/error.hpp"

namespace akv {

template <typename T>
void check_not_null(const T *p, const char *name) {
  if (!p) fail(AKV_ERR_INVALID_ARGUMENT, name, " is NULL");
}

// Copy a caller's option struct over defaults, honouring struct_size (older, smaller
// structs get defaults for the fields they lack; unknown larger ones are rejected).
template <typename T>
T versioned_copy(const T *user, T defaults, const char *name) {
  if (!user) return defaults;
  if (user->struct_size == 0 || user->struct_size > sizeof(T))
    fail(AKV_ERR_INVALID_ARGUMENT, name, "->struct_size ", user->struct_size,
         " is not valid (expected sizeof = ", sizeof(T), "; call the matching *_init first)");
  std::memcpy(static_cast<void *>(&defaults), user, user->struct_size);
  defaults.struct_size = sizeof(T);
  return defaults;
}

// An enum as the integer the caller stored. A C caller can store any int in an enum field,
// and reading an out-of-range value through the C++ enum type is undefined behaviour, so
// validation looks at the bytes before anything reads the enum.
template <typename E>
int32_t raw_enum(const E &e) {
  static_assert(sizeof(E) == sizeof(int32_t), "C enums are int-sized");
  int32_t v;
  std::memcpy(&v, &e, sizeof v);
  return v;
}

void check_enum(int32_t value, int32_t first, int32_t last, const char *name);
// A raw dtype value by its name when it is one ("f32"), else by its number.
std::string dtype_label(int32_t v);
// f32, f16 or bf16 (what callers' tensors may be).
void check_input_dtype(const akv_dtype &t, const char *name);
inline void validate_cache(const akv_cache *cache, const char *name = "cache") { check_not_null(cache, name); }
// q_len >= 1 and the new queries' own keys appended.
void validate_decode(const akv_cache *c, int32_t q_len);

// The caller's options over the defaults, every enum and range checked.
akv_compress_options resolve_options(const akv_compress_options *options);
// A paged prefill (akv_prefill.block_table): the table and its ids, before any data is read.
void validate_paged(const akv_prefill &p);

}  // namespace akv
