// Float lane helpers shared by the kernels (linear_avx2.cpp, float_dot.cpp, attention_avx2.cpp, attention_amx.cpp,
// logits.cpp).
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

// The Cephes expf constants: exp8 here and attention's 16-lane exp16 use these, in the same operations, so both
// give the same floats.
namespace cephes_exp {
constexpr float kLowest = -87.3365f, kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
}  // namespace cephes_exp

// exp on 8 floats (the Cephes expf polynomial, about 1 ulp from torch's exp). Inputs below -87.3 give exp(-87.3),
// about 1e-38: nothing beside attention's largest weight of 1; the sampling weights zero them themselves.
inline __m256 exp8(__m256 x) {
  using namespace cephes_exp;
  x = _mm256_max_ps(x, _mm256_set1_ps(kLowest));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2High), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Low), x);
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 y = _mm256_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kPoly[i]));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.f));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// exp8 on 16 floats (AVX-512, for the attentions' softmax): the same constants and operations lane by lane (floor as a
// round toward -inf), so the same floats.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  using namespace cephes_exp;
  x = _mm512_max_ps(x, _mm512_set1_ps(kLowest));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Low), x);
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(kPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kPoly[i]));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.f));
  const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}
