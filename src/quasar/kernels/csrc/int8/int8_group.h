// Group-wise W8A8 dot products: int8 weights with one scale per output channel and group of G inputs,
// int8 activations with one scale per row and group (Q8_0-style scales, on every int8 path):
//
//   y[m, n] = sum_g (x_scale[m, g] * w_scale[n, g]) * sum_{k in g} q[m, k] * w[n, k]
//
// Each group's int8 dot product is exact in int32 lanes (int8_dot.h explains the two instruction sets:
// "maddubs" reads q, the dpbusd paths read u = q + 128 and start a group's lanes at -128 * sum w), then
// converted to float and scaled once per group. Register widths: 512 bits on AVX-512 VNNI where G is a
// multiple of 64, else 256 bits (VNNI's ymm form, AVX2's maddubs, or the emulated vpdpbusd).
//
// The instruction sets' loops: int8_group_avx2.cpp (maddubs, dpbusd-emulated) and int8_group_avx512.cpp (dpbusd);
// this header has the 256-bit traits and the tiling they share and their entry points, int8_group.cpp picks one.
#pragma once
#include "blocking.h"
#include "simd_lanes.h"

#include <immintrin.h>
#include <algorithm>
#include <cstdint>

namespace int8_group {

struct Float256 {
  using reg = __m256;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg cvt(__m256i v) { return _mm256_cvtepi32_ps(v); }
  static reg set1(float v) { return _mm256_set1_ps(v); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(reg v) { return hsum8(v); }
};

// vpdpbusd emulated exactly in AVX2 (see int8_dot_avx2.cpp): the VNNI arithmetic, testable without VNNI.
struct Emulated256Base {
  using reg = __m256i;
  static constexpr int64_t kBytes = 32;
  static constexpr int kRows = 4;
  static reg zero() { return _mm256_setzero_si256(); }
  static reg c128() { return _mm256_set1_epi8(static_cast<char>(0x80)); }
  static reg load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static reg sub(reg a, reg b) { return _mm256_sub_epi32(a, b); }
  static reg dpbusd(reg acc, reg a, reg b) {
    const __m256i z = _mm256_setzero_si256();
    const __m256i lo = _mm256_madd_epi16(_mm256_unpacklo_epi8(a, z), _mm256_srai_epi16(_mm256_unpacklo_epi8(b, b), 8));
    const __m256i hi = _mm256_madd_epi16(_mm256_unpackhi_epi8(a, z), _mm256_srai_epi16(_mm256_unpackhi_epi8(b, b), 8));
    return _mm256_add_epi32(acc, _mm256_hadd_epi32(lo, hi));
  }
};

// Channels [n0, n1) in tiles small enough to stay in L2 while every row block reads them.
constexpr int64_t kTile = 8;

template <int MAX, typename Block>
void tiles(int64_t M, int64_t n0, int64_t n1, Block block) {
  for (int64_t t = n0; t < n1; t += kTile) {
    const int64_t t1 = std::min(t + kTile, n1);
    row_blocks<MAX>(M, [&](auto rows, int64_t m) { block(rows, m, t, t1); });
  }
}

}  // namespace int8_group

// int8_group_dot on one instruction set: maddubs reads q, the dpbusd loops u = q + 128.
void int8_group_maddubs(const int8_t* q, const float* x_scale, const int8_t* w, const float* w_scale, float* out,
                        int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1);
void int8_group_dpbusd_emulated(const uint8_t* u, const float* x_scale, const int8_t* w, const float* w_scale,
                                float* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1);
void int8_group_dpbusd(const uint8_t* u, const float* x_scale, const int8_t* w, const float* w_scale, float* out,
                       int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1);
