// Reductions over the verifier's logits rows: the greedy token of each row (argmax_rows).
//
// torch.argmax on one 49k-vocabulary row took 90 us warm and 140 us right after a forward on a 2-core VM
// (a parallel reduction's dispatch and fork for a few microseconds of work); a verify step takes it over
// k + 1 rows. Here: two passes over each row in the calling thread, 16 floats per step, with torch's
// answer: the first index of the largest value, and the first NaN where a row holds one (torch orders NaN
// above every number).
#include "kernels.h"
#include <immintrin.h>
#include <cmath>

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
