/* See raw_enums.h: C lets any int through an enum parameter or field. */
#include "api/raw_enums.h"

void akv_test_set_backend(akv_context_options *options, int value) { options->backend = (akv_backend)value; }
void akv_test_set_method(akv_compress_options *options, int value) { options->method = (akv_method)value; }
void akv_test_set_rope_style(akv_compress_options *options, int value) {
  options->rope.style = (akv_rope_style)value;
}
void akv_test_set_storage_dtype(akv_compress_options *options, int value) {
  options->storage_dtype = (akv_dtype)value;
}
void akv_test_set_prefill_dtype(akv_prefill *prefill, int value) { prefill->dtype = (akv_dtype)value; }

const char *akv_test_status_string(int status) { return akv_status_string((akv_status)status); }

akv_status akv_test_append(akv_cache *cache, const void *keys, const void *values, int dtype, int32_t num_tokens,
                           const int32_t *positions) {
  return akv_append(cache, keys, values, (akv_dtype)dtype, num_tokens, positions, NULL);
}

akv_status akv_test_decode(akv_cache *cache, const void *queries, int dtype, int32_t q_len, void *out) {
  return akv_decode(cache, queries, (akv_dtype)dtype, q_len, out, NULL);
}

akv_status akv_test_decode_batch(akv_context *context, akv_cache *const *caches, int32_t batch, const void *queries,
                                 int dtype, int32_t q_len, void *out) {
  return akv_decode_batch(context, caches, batch, queries, (akv_dtype)dtype, q_len, out, NULL);
}

akv_status akv_test_reconstruct(const akv_cache *cache, int dtype, int32_t rotated, void *keys, void *values) {
  return akv_cache_reconstruct(cache, (akv_dtype)dtype, rotated, keys, values, NULL, NULL);
}

void akv_test_set_pool_type(akv_compress_options *options, int value) { options->pool_type = (akv_pool_type)value; }
