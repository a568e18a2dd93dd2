// Exact attention in double precision, from the uncompressed post-RoPE keys: the reference
// every method's akv_decode output is compared against, and the window attention the needle
// planter uses to make sure the observation window does not single a needle out.
#pragma once

#include <cstdint>
#include <vector>

namespace akvcli {

// Shape of the attention a set of queries pays (averaged over the queries added).
struct AttentionProfile {
  double sink_mass = 0.0;         // weight on prompt token 0
  double top_percent_mass = 0.0;  // weight on the top 1% of tokens
  double effective_tokens = 0.0;  // exp(entropy)
  int64_t count = 0;

  void add(const double *weights, int64_t n);  // one query's softmax weights
  void merge(const AttentionProfile &other);
  double mean(double sum) const { return count ? sum / static_cast<double>(count) : 0.0; }
};

// out[i] = softmax(scale * q_i . K^T) V for nq queries that each see all n keys.
// keys: [n][D] post-RoPE, values: [n][D]. weights_out (optional): [nq][n].
void exact_attention(const double *keys, const double *values, int64_t n, int head_dim,
                     const double *queries, int nq, double scale, double *out,
                     AttentionProfile *profile = nullptr, std::vector<double> *weights_out = nullptr);

// Window attention of one KV head (SPEC 2 step 1): rows are the G*W window queries of the
// head's query group ([G][W][D]); row (g, w) sees tokens t <= S - W + w.
struct WindowAttention {
  std::vector<double> row_lse;  // log-sum-exp of each row's scaled logits
  std::vector<double> score;    // [S - W] mean over rows of the softmax weight of token t
  double median_score = 0.0;
};
WindowAttention window_attention(const double *keys, int64_t seq_len, int head_dim,
                                 const double *window_queries, int group, int window,
                                 double scale);

}  // namespace akvcli
