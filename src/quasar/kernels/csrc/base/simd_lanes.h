// The register-width layer: every fixed-order reduction of float lanes (and exp), written once.
//
// The contract: every kernel path (AVX2, AVX-512, AVX512-BF16, the int8 paths) gives bitwise the same floats, so
// every horizontal sum and maximum a path takes must add its lanes in one fixed order, the one written here:
//   hsum8(v):      lanes j and j + 4 (the two 128-bit halves), then j and j + 2 (movehl), then lanes 0 and 1.
//   hsum8x2(a, b): lane j of a plus lane j of b first, then hsum8.
//   hsum16(v):     the two 256-bit halves added lane by lane (lane j plus lane j + 8), then hsum8, so a 16-lane
//                  AVX-512 accumulator gives the float that two 8-lane AVX2 accumulators give (hsum8x2).
//   max8(v):       the halves, then movehl, then lanes 0 and 1 (std::max), in that order (exact in any order for
//                  numbers; fixed so that NaNs propagate the same way everywhere).
//   max16(v):      the compiler's 16-lane maximum (_mm512_reduce_max_ps): exact for numbers, as max8.
//   hsum8_epi32:   the 8 int32 lanes (exact in any order; the AVX-512 int8 path sums its 16 with _mm512_reduce_add_epi32).
//   exp8 / exp16:  the Cephes expf polynomial, the same constants and operations on 8 or 16 lanes.
// A kernel that needs one of these includes this header and calls it; no kernel re-types a reduction. Two sums are
// not here on purpose: attention's half_sums8 (attention_avx2.cpp), which is hsum8's order for 8 keys at once in
// shuffles, and the AMX attention's softmax total (_mm512_reduce_add_ps), a path whose floats are its own.
// The AVX-512 functions carry their own target attribute, so they can be called from any AVX-512 target region
// (GCC inlines a function into a caller whose instruction set contains the callee's); the others need only the
// AVX2 + FMA baseline every file is compiled with.
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

#include "targets.h"

// Sum of the 8 lanes of v in the fixed order above.
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sum of the 8 lanes of a + b: lane j of a plus lane j of b, then hsum8.
inline float hsum8x2(__m256 a, __m256 b) { return hsum8(_mm256_add_ps(a, b)); }

// Sum of the 16 lanes of v: its 256-bit halves as hsum8x2 sums two AVX2 registers.
__attribute__((target(QUASAR_AVX512F))) inline float hsum16(__m512 v) {
  return hsum8x2(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// Maximum of the 8 lanes of v in the fixed order above.
inline float max8(__m256 v) {
  __m128 t = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_max_ps(t, _mm_movehl_ps(t, t));
  return std::max(_mm_cvtss_f32(t), _mm_cvtss_f32(_mm_movehdup_ps(t)));
}

// Maximum of the 16 lanes of v.
__attribute__((target(QUASAR_AVX512F))) inline float max16(__m512 v) { return _mm512_reduce_max_ps(v); }

// Sum of the 8 int32 lanes of v (exact: any order gives the same int32).
inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// The Cephes expf constants: exp8 and exp16 use these, in the same operations, so both give the same floats.
// kLowest is also the bound below which the sampling weights count a logit as zero (logits.cpp).
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
__attribute__((target(QUASAR_AVX512F))) inline __m512 exp16(__m512 x) {
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
