// The verifier's logits rows to tokens: the greedy token of each row (argmax_rows), and at temperature > 0 the
// sampling weights, the filters' cut and one draw (sampling_weights, keep_weights, draw_index; quasar.sampling).
//
// torch.argmax on one 49k-vocabulary row took 90 us warm and 140 us right after a forward on a 2-core VM
// (a parallel reduction's dispatch and fork for a few microseconds of work); a verify step takes it over
// k + 1 rows. Here: two passes over each row in the calling thread, 16 floats per step, with torch's
// answer: the first index of the largest value, and the first NaN where a row holds one (torch orders NaN
// above every number).
#include "kernels.h"
#include "float_lanes.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// The first index of the largest value of row[0, V), or of the first NaN.
int64_t argmax_row(const float* row, int64_t V) {
  __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(row + v);
    top = _mm256_max_ps(top, x);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  float best = -INFINITY;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  for (float lane : lanes) best = std::max(best, lane);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t t = v; t < V; ++t) {
    any_nan = any_nan || std::isnan(row[t]);
    best = std::max(best, row[t]);
  }
  if (any_nan) {
    for (int64_t t = 0; t < V; ++t)
      if (std::isnan(row[t])) return t;
  }
  const __m256 best8 = _mm256_set1_ps(best);
  for (v = 0; v + 8 <= V; v += 8) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + v), best8, _CMP_EQ_OQ));
    if (hits) return v + __builtin_ctz(hits);
  }
  for (; v < V; ++v)
    if (row[v] == best) return v;
  return 0;  // a row of -inf only: every value ties at the first
}

}  // namespace

// logits [R, V] float32 -> int64 [R]: torch.argmax(logits, -1), the same indices.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dtype() == torch::kFloat32 && logits.dim() == 2 && logits.device().is_cpu() && logits.size(1) > 0,
              "float32 CPU logits [R, V] expected");
  logits = logits.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = torch::empty({R}, logits.options().dtype(torch::kInt64));
  const float* p = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) o[r] = argmax_row(p + r * V, V);
  return out;
}

// ---- sampling (quasar.sampling): the filtered weights of a row and one draw from them ----------------------

namespace {

double lane_sum(__m256d a, __m256d b) {
  alignas(32) double s[4];
  _mm256_store_pd(s, _mm256_add_pd(a, b));
  return (s[0] + s[1]) + (s[2] + s[3]);
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(),
              "contiguous float32 CPU ", what, " [R, V] expected");
}

}  // namespace

// out[r, v] = exp((logits[r, v] - max_v logits[r]) * inv_t), float32, each product rounded as torch's
// (logits - top).mul_(inv_t); returns each row's sum (float64): quasar.sampling's weights before its filters.
std::vector<double> sampling_weights(torch::Tensor logits, torch::Tensor out, double inv_t) {
  check_rows(logits, "logits");
  check_rows(out, "weights");
  TORCH_CHECK(out.sizes() == logits.sizes(), "weights of the logits' shape expected");
  const int64_t R = logits.size(0), V = logits.size(1);
  const float scale = static_cast<float>(inv_t);
  std::vector<double> sums(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = logits.data_ptr<float>() + r * V;
    float* w = out.data_ptr<float>() + r * V;
    __m256 top_lanes = _mm256_set1_ps(-INFINITY);
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) top_lanes = _mm256_max_ps(top_lanes, _mm256_loadu_ps(row + v));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top_lanes);
    float top = -INFINITY;
    for (float lane : lanes) top = std::max(top, lane);
    for (; v < V; ++v) top = std::max(top, row[v]);
    const __m256 top8 = _mm256_set1_ps(top), scale8 = _mm256_set1_ps(scale);
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (v = 0; v + 8 <= V; v += 8) {
      const __m256 x = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(row + v), top8), scale8);
      // exp8 stops at exp(-87.3); below that (a -inf logit among them) the weight is 0, as a filtered-out token's
      const __m256 e = _mm256_and_ps(exp8(x), _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365f), _CMP_GE_OQ));
      _mm256_storeu_ps(w + v, e);
      lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double sum = lane_sum(lo, hi);
    for (; v < V; ++v) {
      const float x = (row[v] - top) * scale;
      w[v] = x >= -87.3365f ? std::exp(x) : 0.f;
      sum += w[v];
    }
    sums[r] = sum;
  }
  return sums;
}

// weights[r, v] = 0 where logits[r, v] < keep_from[r] (the filters' lowest kept logit); returns the rows' new sums.
std::vector<double> keep_weights(torch::Tensor logits, torch::Tensor weights, torch::Tensor keep_from) {
  check_rows(logits, "logits");
  check_rows(weights, "weights");
  TORCH_CHECK(weights.sizes() == logits.sizes() && keep_from.dtype() == torch::kFloat32 &&
              keep_from.numel() == logits.size(0), "weights of the logits' shape and one float32 threshold per row expected");
  keep_from = keep_from.contiguous();
  const int64_t R = logits.size(0), V = logits.size(1);
  std::vector<double> sums(R);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = logits.data_ptr<float>() + r * V;
    float* w = weights.data_ptr<float>() + r * V;
    const float from = keep_from.data_ptr<float>()[r];
    double sum = 0;
    for (int64_t v = 0; v < V; ++v) {
      if (row[v] < from) w[v] = 0.f;
      sum += w[v];
    }
    sums[r] = sum;
  }
  return sums;
}

// One index from weights [V] (>= 0) at the uniform number u in [0, 1): the first v whose running float64 sum
// passes u * total, as torch.searchsorted(torch.cumsum(weights, 0, dtype=float64), u * total, right=True); the last
// nonzero weight's index where rounding carries u * total to the total; -1 when every weight is 0.
int64_t draw_index(torch::Tensor weights, double u) {
  TORCH_CHECK(weights.dtype() == torch::kFloat32 && weights.dim() == 1 && weights.is_contiguous() && weights.device().is_cpu(),
              "contiguous float32 CPU weights [V] expected");
  const float* w = weights.data_ptr<float>();
  const int64_t V = weights.size(0);
  double total = 0;
  int64_t last = -1;
  for (int64_t v = 0; v < V; ++v) {
    total += w[v];
    if (w[v] != 0.f) last = v;
  }
  if (!(total > 0)) return -1;
  const double at = u * total;
  double running = 0;
  for (int64_t v = 0; v < V; ++v) {
    running += w[v];
    if (running > at) return v;
  }
  return last;
}
