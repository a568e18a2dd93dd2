/* Out-of-range enum values, as a C caller can pass them through the C ABI. Producing such a
 * value in C++ is undefined behaviour (and UBSan says so), so the C++ tests build them in C. */
#ifndef AKV_TEST_RAW_ENUMS_H
#define AKV_TEST_RAW_ENUMS_H

#include <anchorkv/anchorkv.h>

#ifdef __cplusplus
extern "C" {
#endif

void akv_test_set_backend(akv_context_options *options, int value);
void akv_test_set_method(akv_compress_options *options, int value);
void akv_test_set_rope_style(akv_compress_options *options, int value);
void akv_test_set_storage_dtype(akv_compress_options *options, int value);
void akv_test_set_prefill_dtype(akv_prefill *prefill, int value);
void akv_test_set_pool_type(akv_compress_options *options, int value);
const char *akv_test_status_string(int status);
akv_status akv_test_append(akv_cache *cache, const void *keys, const void *values, int dtype, int32_t num_tokens,
                           const int32_t *positions);
akv_status akv_test_decode(akv_cache *cache, const void *queries, int dtype, int32_t q_len, void *out);
akv_status akv_test_decode_batch(akv_context *context, akv_cache *const *caches, int32_t batch, const void *queries,
                                 int dtype, int32_t q_len, void *out);
akv_status akv_test_reconstruct(const akv_cache *cache, int dtype, int32_t rotated, void *keys, void *values);

#ifdef __cplusplus
}
#endif

#endif
