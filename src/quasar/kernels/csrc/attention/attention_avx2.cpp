// Attention of rows sharing one kv head over its keys on AVX2 (attention.cpp says what every path computes): scores
// as float32 FMA chains over d then hsum8, the softmax numerators by exp8, the weighted values in order of j.
#include "attention_rows.h"
#include "simd_lanes.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* a, const float* b, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return hsum8(acc);
}

// Scores s_j = (q . k_j) * scale for keys [j0, j1): each one float32 chain of FMAs over d, then hsum8.
// Four keys run at a time for instruction-level parallelism; the grouping does not change any result.
void score_range(const float* q, const float* keys, int64_t j0, int64_t j1, int64_t D, float scale, float* scores) {
  int64_t j = j0;
  for (; j + 4 <= j1; j += 4) {
    const float *k0 = keys + j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
      a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
      a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
      a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
    }
    scores[j] = hsum8(a0) * scale;
    scores[j + 1] = hsum8(a1) * scale;
    scores[j + 2] = hsum8(a2) * scale;
    scores[j + 3] = hsum8(a3) * scale;
  }
  for (; j < j1; ++j) scores[j] = dot(q, keys + j * D, D) * scale;
}

// scores[0, n) -> e_j = exp(s_j - max s) in place (zero-padded to a multiple of 8); returns sum_j e_j.
float softmax_numerators(float* scores, int64_t n) {
  const int64_t padded = (n + 7) / 8 * 8;
  __m256 top8 = _mm256_set1_ps(-INFINITY);  // the maximum is exact in any order: 8 lanes, then across them
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(scores + j));
  float top = max8(top8);
  for (; j < n; ++j) top = std::max(top, scores[j]);
  for (j = n; j < padded; ++j) scores[j] = top;  // exp(0) = 1, zeroed below
  __m256 total = _mm256_setzero_ps();
  top8 = _mm256_set1_ps(top);
  for (j = 0; j < padded; j += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top8));
    if (j + 8 > n) {  // the lanes past the last key count zero
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n - j)), lane);
      e = _mm256_and_ps(e, _mm256_castsi256_ps(valid));
    }
    _mm256_storeu_ps(scores + j, e);
    total = _mm256_add_ps(total, e);
  }
  return hsum8(total);
}

// acc[W] += sum_{j in [j0, j1)} e_j v_j[d0 : d0 + W], in order of j, one accumulator per 8 dims (kept in
// registers: W is a compile-time 8..64).
template <int W>
void weigh_values(const float* e, const float* values, int64_t j0, int64_t j1, int64_t D, int64_t d0, float* acc_out) {
  __m256 acc[W / 8];
  for (int b = 0; b < W / 8; ++b) acc[b] = _mm256_loadu_ps(acc_out + 8 * b);
  for (int64_t j = j0; j < j1; ++j) {
    const __m256 ej = _mm256_set1_ps(e[j]);
    const float* vj = values + j * D + d0;
    for (int b = 0; b < W / 8; ++b) acc[b] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(vj + 8 * b), acc[b]);
  }
  for (int b = 0; b < W / 8; ++b) _mm256_storeu_ps(acc_out + 8 * b, acc[b]);
}

using WeighFn = void (*)(const float*, const float*, int64_t, int64_t, int64_t, int64_t, float*);
constexpr WeighFn kWeigh[8] = {weigh_values<8>, weigh_values<16>, weigh_values<24>, weigh_values<32>,
                               weigh_values<40>, weigh_values<48>, weigh_values<56>, weigh_values<64>};

}  // namespace

// Rows sharing one kv head against keys first..last of each, D dims. Keys and values are read in blocks of
// 16 KB, and each block serves every row while it sits in the L1 cache: per row, the same operations in
// the same order as attending to it alone (scores over d, softmax from its first key, the weighted sum over j in
// order), so a row's output never depends on the other rows, only the cache traffic does.
void attend_rows_avx2(const std::vector<AttentionRow>& rows, const float* keys, const float* values, int64_t D, float scale,
                 std::vector<float>& scores) {
  int64_t n_max = 0, lo = INT64_MAX;
  for (const AttentionRow& r : rows) {
    n_max = std::max(n_max, r.last + 1);
    lo = std::min(lo, r.first);
  }
  // + 8: a row's softmax pads its scores from its first key to a multiple of 8, up to 7 past its last
  const int64_t stride = (n_max + 7) / 8 * 8 + 8, block = std::max<int64_t>(8, 4096 / D);
  scores.resize(rows.size() * stride);
  for (int64_t j0 = lo; j0 < n_max; j0 += block)
    for (size_t r = 0; r < rows.size(); ++r)
      score_range(rows[r].q, keys, std::max(j0, rows[r].first), std::min(j0 + block, in_place_end(rows[r])), D,
                  scale, scores.data() + r * stride);
  for (size_t r = 0; r < rows.size(); ++r)  // a tree row's ancestors, each as score_range scores a key in place
    for (int64_t j = std::max(in_place_end(rows[r]), rows[r].first); j <= rows[r].last; ++j)
      score_range(rows[r].q, keys + (rows[r].tail[j - rows[r].tail_from] - j) * D, j, j + 1, D, scale,
                  scores.data() + r * stride);
  std::vector<float> norm(rows.size());
  for (size_t r = 0; r < rows.size(); ++r)
    norm[r] = softmax_numerators(scores.data() + r * stride + rows[r].first, rows[r].last + 1 - rows[r].first);
  constexpr int64_t kBlock = 64;  // output dims per pass: 8 accumulators of 8
  for (int64_t d0 = 0; d0 < D; d0 += kBlock) {
    const int64_t width = std::min(kBlock, D - d0);
    for (const AttentionRow& r : rows) std::fill(r.out + d0, r.out + d0 + width, 0.f);
    for (int64_t j0 = lo; j0 < n_max; j0 += block)
      for (size_t r = 0; r < rows.size(); ++r)
        kWeigh[width / 8 - 1](scores.data() + r * stride, values, std::max(j0, rows[r].first),
                              std::min(j0 + block, in_place_end(rows[r])), D, d0, rows[r].out + d0);
    for (size_t r = 0; r < rows.size(); ++r)  // then a tree row's ancestors, still in order of j
      for (int64_t j = std::max(in_place_end(rows[r]), rows[r].first); j <= rows[r].last; ++j)
        kWeigh[width / 8 - 1](scores.data() + r * stride, values + (rows[r].tail[j - rows[r].tail_from] - j) * D, j,
                              j + 1, D, d0, rows[r].out + d0);
    for (size_t r = 0; r < rows.size(); ++r) {
      const __m256 n8 = _mm256_set1_ps(norm[r]);
      for (int64_t d = d0; d < d0 + width; d += 8)
        _mm256_storeu_ps(rows[r].out + d, _mm256_div_ps(_mm256_loadu_ps(rows[r].out + d), n8));
    }
  }
}
