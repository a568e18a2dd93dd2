/* Compress one layer's KV cache ~10x, decode a new token, compare with exact attention.
 * Build: cc quickstart.c $(pkg-config --cflags --libs anchorkv) -lm */
#include <anchorkv/anchorkv.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

enum { H = 2, HQ = 4, S = 1024, D = 64, W = 32 }; /* KV heads, query heads, prompt, head dim, window */

#define CHECK(call)                                                                      \
  do {                                                                                   \
    akv_status status_ = (call);                                                         \
    if (status_ != AKV_OK) {                                                             \
      fprintf(stderr, "%s failed: %s (%s)\n", #call, akv_status_string(status_),         \
              akv_last_error_message());                                                 \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

static uint64_t rng_state = 0x2545f4914f6cdd1dULL;
static double uniform(void) { /* xorshift64 */
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return ((double)(rng_state >> 11) + 0.5) / 9007199254740992.0;
}
static double gaussian(void) { return sqrt(-2.0 * log(uniform())) * cos(6.283185307179586 * uniform()); }

/* NeoX RoPE (base 10000) of one row at `position`: what the model applied to its keys. */
static void rope(const float *row, int position, double *out) {
  for (int i = 0; i < D / 2; ++i) {
    double angle = position * pow(10000.0, -(double)i / (D / 2));
    double a = row[i], b = row[i + D / 2];
    out[i] = a * cos(angle) - b * sin(angle);
    out[i + D / 2] = b * cos(angle) + a * sin(angle);
  }
}

static float keys[H * S * D], values[H * S * D], window[HQ * W * D], query[HQ * D], out[HQ * D];
static double rotated[H * S * D], basis[H * 8 * D], expected[HQ * D];
static int topics[HQ * 4];

/* A query of head j that looks for one of its "topic" tokens. */
static void query_row(int j, float *row) {
  const double *key = &rotated[((size_t)(j / (HQ / H)) * S + topics[j * 4 + (int)(uniform() * 4)]) * D];
  double norm = 0;
  for (int d = 0; d < D; ++d) norm += key[d] * key[d];
  for (int d = 0; d < D; ++d) row[d] = (float)(3.0 * key[d] / sqrt(norm) * pow(D, 0.25) + 0.5 * gaussian());
}

int main(void) {
  /* Synthetic layer: keys drift smoothly over 8 directions per head; values are noise. */
  for (int i = 0; i < H * 8 * D; ++i) basis[i] = gaussian();
  for (int h = 0; h < H; ++h) {
    double walk[8] = {0};
    for (int t = 0; t < S; ++t) {
      for (int r = 0; r < 8; ++r) walk[r] += gaussian() / sqrt(S);
      for (int d = 0; d < D; ++d) {
        double drift = 0;
        for (int r = 0; r < 8; ++r) drift += walk[r] * basis[(h * 8 + r) * D + d];
        keys[((size_t)h * S + t) * D + d] = (float)(drift + 0.3 * gaussian());
      }
      rope(&keys[((size_t)h * S + t) * D], t, &rotated[((size_t)h * S + t) * D]);
    }
  }
  for (int i = 0; i < H * S * D; ++i) values[i] = (float)gaussian();
  for (int i = 0; i < HQ * 4; ++i) topics[i] = (int)(uniform() * (S - W));
  for (int j = 0; j < HQ; ++j)
    for (int w = 0; w < W; ++w) query_row(j, &window[((size_t)j * W + w) * D]);
  for (int j = 0; j < HQ; ++j) query_row(j, &query[j * D]);

  /* Compress at 10x, decode one query. */
  akv_context *context = NULL;
  CHECK(akv_context_create(NULL, &context));
  akv_compress_options options;
  akv_compress_options_init(&options);
  options.retain_fraction = 0.1;
  akv_prefill prefill;
  akv_prefill_init(&prefill);
  prefill.shape.seq_len = S;
  prefill.shape.num_kv_heads = H;
  prefill.shape.num_q_heads = HQ;
  prefill.shape.head_dim = D;
  prefill.dtype = AKV_DTYPE_F32;
  prefill.keys = keys;
  prefill.values = values;
  prefill.queries = window;
  size_t planned_bytes = 0;
  CHECK(akv_compressed_size(&options, &prefill.shape, &planned_bytes));
  akv_cache *cache = NULL;
  CHECK(akv_compress(context, &prefill, &options, &cache, NULL));
  CHECK(akv_decode(cache, query, AKV_DTYPE_F32, 1, out, NULL));

  /* Exact attention over the original keys and values. */
  for (int j = 0; j < HQ; ++j) {
    const int h = j / (HQ / H);
    static double logits[S];
    double max = -INFINITY, total = 0;
    for (int t = 0; t < S; ++t) {
      double dot = 0;
      for (int d = 0; d < D; ++d) dot += rotated[((size_t)h * S + t) * D + d] * query[j * D + d];
      logits[t] = dot / sqrt(D);
      if (logits[t] > max) max = logits[t];
    }
    for (int t = 0; t < S; ++t) total += (logits[t] = exp(logits[t] - max));
    for (int t = 0; t < S; ++t)
      for (int d = 0; d < D; ++d) expected[j * D + d] += logits[t] / total * values[((size_t)h * S + t) * D + d];
  }
  double dot = 0, norm_out = 0, norm_expected = 0;
  for (int i = 0; i < HQ * D; ++i) {
    dot += out[i] * expected[i];
    norm_out += (double)out[i] * out[i];
    norm_expected += expected[i] * expected[i];
  }
  const double cosine = dot / sqrt(norm_out * norm_expected);

  akv_cache_stats stats = {0};
  stats.struct_size = sizeof stats;
  CHECK(akv_cache_stats_get(cache, &stats));

  /* Serialize, deserialize, decode again: the same bytes give the same answer. */
  size_t size = 0, written = 0;
  CHECK(akv_cache_serialized_size(cache, &size));
  unsigned char *bytes = malloc(size);
  CHECK(akv_cache_serialize(cache, bytes, size, &written, NULL));
  akv_cache *restored = NULL;
  CHECK(akv_cache_deserialize(context, bytes, written, &restored, NULL));
  float again[HQ * D];
  CHECK(akv_decode(restored, query, AKV_DTYPE_F32, 1, again, NULL));
  int same = 1;
  for (int i = 0; i < HQ * D; ++i) same &= again[i] == out[i];

  printf("anchorkv C: %.1fx smaller (%llu of %llu bytes), cosine to exact attention %.4f\n", stats.ratio,
         (unsigned long long)stats.compressed_bytes, (unsigned long long)stats.full_bytes, cosine);
  free(bytes);
  akv_cache_destroy(restored);
  akv_cache_destroy(cache);
  akv_context_destroy(context);
  const int ok = same && stats.compressed_bytes == planned_bytes && stats.compressed_bytes <= stats.budget_bytes &&
                 cosine > 0.8;
  if (!ok) fprintf(stderr, "check failed\n");
  return ok ? 0 : 1;
}
