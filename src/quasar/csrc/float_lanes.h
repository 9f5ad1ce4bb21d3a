// Float lane sums shared by the kernels (linear_avx2.cpp, float_dot.cpp).
#pragma once
#include <immintrin.h>

// Sum of the 8 lanes of a + b, always in the same order: lane j of a plus lane j of b, then the halves,
// then pairs. A 16-lane AVX-512 accumulator is summed as its two 256-bit halves, so both instruction sets
// give the same float.
inline float hsum_ps(__m256 a, __m256 b) {
  const __m256 v = _mm256_add_ps(a, b);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
