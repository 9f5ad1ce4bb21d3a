// RMSNorm and the per-token int8 quantization of the W8A8 linears' inputs, row by row on AVX2 (the same bytes as
// quasar.quant.int8.quantize_tokens), for the W8A8 front end (w8a8_linear.cpp) and packed_w8a8_step.cpp.
#include "kernel_ops.h"
#include "blocking.h"
#include "simd_lanes.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>

// RMSNorm of each row of x [M, K]: y = weight * (x * (1 / sqrt(mean(x^2) + eps))), float32, the sum of squares in a
// fixed order (8 lanes, then the lanes), so a row's result depends on that row only.
void rms_norm_rows(const float* x, const float* weight, int64_t M, int64_t K, double eps, float* y) {
  over_rows(M, K, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(x + m * K, weight, K, eps, y + m * K);
  });
}

// y [K] = weight * (x * (1 / sqrt(mean(x^2) + eps))), the sum of squares on 8 lanes, then across them; y may be x.
void norm_row(const float* x, const float* weight, int64_t K, double eps, float* y) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  const float inv = 1.f / std::sqrt(hsum8x2(acc, _mm256_setzero_ps()) / static_cast<float>(K) + static_cast<float>(eps));
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < K; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(weight + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), inv8)));
}

namespace {

// The same operations as quasar.quant.int8.quantize_tokens on one group (IEEE division by the scale, round half to
// even, clamp), eight lanes at a time; G is a multiple of 16.
void quantize_group(const float* x, int64_t G, int8_t* q, float* scale) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256 top = _mm256_setzero_ps();
  for (int64_t k = 0; k < G; k += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(x + k)));
  const float absmax = max8(top);
  const float s = absmax > 0.f ? absmax / 127.f : 1.f;
  *scale = s;
  const __m256 s8 = _mm256_set1_ps(s);
  for (int64_t k = 0; k < G; k += 16) {
    __m256i v[2];
    for (int h = 0; h < 2; ++h) {
      __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k + 8 * h), s8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[h] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    }
    const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);  // 16 int16 in order
    const __m128i w8 = _mm_packs_epi16(_mm256_castsi256_si128(w16), _mm256_extracti128_si256(w16, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k), w8);
  }
}

}  // namespace

// Quantize each group of G values of each row of x [M, K] to int8 values in [-127, 127]; write the scales
// [M, K / G] (G = K: one scale per row), group by group (quantize_group).
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int8_t* q, float* scale) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K; g += G) quantize_group(x + m * K + g, G, q + m * K + g, scale + (m * K + g) / G);
}
