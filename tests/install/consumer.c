/* A program outside the project, built against an installed anchorkv (pkg-config and
 * find_package): checks that the installed header, library and package files work. */
#include <anchorkv/anchorkv.h>

#include <stdio.h>

static int fail(const char *what, akv_status status) {
  fprintf(stderr, "consumer: %s failed: %s (%s)\n", what, akv_status_string(status),
          akv_last_error_message());
  return 1;
}

int main(void) {
  akv_context *context = NULL;
  akv_compress_options options;
  akv_shape shape;
  akv_status status;
  size_t bytes = 0;
  double full_bytes;

  /* The header this program was compiled with must match the library it loaded. */
  if (akv_version_number() != AKV_VERSION_NUMBER) {
    fprintf(stderr, "consumer: header %s but library %s\n", AKV_VERSION_STRING,
            akv_version_string());
    return 1;
  }

  status = akv_context_create(NULL, &context);
  if (status != AKV_OK) return fail("akv_context_create", status);

  /* The paper's example layer: 32K prompt, 8 KV heads, 32 query heads, head_dim 128. */
  akv_compress_options_init(&options);
  shape.seq_len = 32768;
  shape.num_kv_heads = 8;
  shape.num_q_heads = 32;
  shape.head_dim = 128;
  status = akv_compressed_size(&options, &shape, &bytes);
  akv_context_destroy(context);
  if (status != AKV_OK) return fail("akv_compressed_size", status);

  full_bytes = 4.0 * (double)shape.seq_len * shape.num_kv_heads * shape.head_dim;
  if (bytes == 0 || (double)bytes > options.retain_fraction * full_bytes) {
    fprintf(stderr, "consumer: %zu bytes is outside (0, %.0f]\n", bytes,
            options.retain_fraction * full_bytes);
    return 1;
  }
  printf("anchorkv %s: compressed_size(S=32768,H=8,Hq=32,D=128,theta=%.2f) = %zu bytes "
         "(%.2fx)\n",
         akv_version_string(), options.retain_fraction, bytes, full_bytes / (double)bytes);
  return 0;
}
