// The float-activation linears on AVX2 (float_dot.h has the arithmetic and the entry points): float_act_linear's
// 16 lanes in two 8-lane registers, bf16_linear's pairs as two FMAs on 8 channels a register, fp32_linear's chains
// on 8 channels a register.
#include "float_dot.h"
#include "simd_lanes.h"

#include <immintrin.h>

using namespace float_dot;

namespace {

// Eight weights widened to float32.
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 widen8(const uint16_t* p) {  // bfloat16: the high half of a float32
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Float32 x: lanes k % 16 < 8 in lo, the others in hi. R <= 3, C <= 2 fill the 16 registers.
template <int R, int C, typename W>
void act32_tile_avx2(const float* x, const W* w, float* y, int64_t m0, int64_t n0, int64_t N, int64_t K) {
  __m256 acc[2][R][C];
#pragma GCC unroll 16
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[h][r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) prefetch_row(w + (n0 + c) * K + k);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 wv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) wv[c] = widen8(w + (n0 + c) * K + k + 8 * h);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * K + k + 8 * h);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[h][r][c] = _mm256_fmadd_ps(wv[c], xv, acc[h][r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = hsum8x2(acc[0][r][c], acc[1][r][c]);
}

// The AVX2 packed tiles' accumulators, two 8-lane halves per panel: zero, or the partial sums in y after the
// first chunk of K; and back into y.
template <int R, int C>
inline void start_acc(__m256 (&acc)[R][C][2], const float* y, int64_t m0, int64_t p0, int64_t N, int64_t k0) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h)
        acc[r][c][h] = k0 ? _mm256_loadu_ps(y + (m0 + r) * N + 16 * (p0 + c) + 8 * h) : _mm256_setzero_ps();
}

template <int R, int C>
inline void store_acc(const __m256 (&acc)[R][C][2], float* y, int64_t m0, int64_t p0, int64_t N) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + r) * N + 16 * (p0 + c) + 8 * h, acc[r][c][h]);
}

// vdpbf16ps in two FMAs per pair, 8 channels a register: a 32-bit lane holding a pair gives its odd element
// as the high half (mask) and its even one shifted up. Inputs [k0, k1) of rows m0.. and panels p0..; the
// partial sums come from y after the first chunk. R <= 4, C = 1 fill the 16 registers.
template <int R, int C>
void bf16_tile_avx2(const uint16_t* x, const uint16_t* wp, float* y, int64_t m0, int64_t p0, int64_t N, int64_t K,
                    int64_t k0, int64_t k1) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[R][C][2];
  start_acc<R, C>(acc, y, m0, p0, N, k0);
  for (int64_t k = k0; k < k1; k += 2) {
    __m256 w_odd[C][2], w_even[C][2];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const uint16_t* panel = wp + (p0 + c) * K * 16 + k * 16;
      prefetch_row(panel);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 16 * h));
        w_odd[c][h] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        w_even[c][h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256i v = _mm256_set1_epi32(pair_at(x + (m0 + r) * K + k));
      const __m256 x_odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
      const __m256 x_even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) {
          acc[r][c][h] = _mm256_fmadd_ps(x_odd, w_odd[c][h], acc[r][c][h]);
          acc[r][c][h] = _mm256_fmadd_ps(x_even, w_even[c][h], acc[r][c][h]);
        }
    }
  }
  store_acc<R, C>(acc, y, m0, p0, N);
}

// Float32 x times float32 (or bfloat16, widened) weights packed [N/16][K][16]: x[m, k] broadcast, one FMA per
// 8 channels and input, each channel's sum one chain in k order. R <= 6, C = 1 (12 accumulators, 2 weights, x).
template <int R, int C, typename W>
void fp32_tile_avx2(const float* x, const W* wp, float* y, int64_t m0, int64_t p0, int64_t N, int64_t K, int64_t k0,
                    int64_t k1) {
  __m256 acc[R][C][2];
  start_acc<R, C>(acc, y, m0, p0, N, k0);
  for (int64_t k = k0; k < k1; ++k) {
    __m256 wv[C][2];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const W* panel = wp + ((p0 + c) * K + k) * 16;
      prefetch_row(panel);
      wv[c][0] = widen8(panel);
      wv[c][1] = widen8(panel + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + (m0 + r) * K + k);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        for (int h = 0; h < 2; ++h) acc[r][c][h] = _mm256_fmadd_ps(xv, wv[c][h], acc[r][c][h]);
    }
  }
  store_acc<R, C>(acc, y, m0, p0, N);
}

}  // namespace

template <typename W>
void act32_avx2(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const auto tile = [&](auto rows, auto cols, int64_t m, int64_t n) {
    act32_tile_avx2<decltype(rows)::value, decltype(cols)::value>(x, w, y, m, n, N, K);
  };
  if (M <= 2)  // as act32_avx512
    tiles<2, 1>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), tile);
  else
    tiles<3, 2>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), tile);
}

template void act32_avx2(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void act32_avx2(const float*, const int8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void act32_avx2(const float*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

void bf16_panels_avx2(const uint16_t* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                      int64_t p1) {
  panel_tiles<4, 1>(M, p0, p1, K, 32, 2, [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
    bf16_tile_avx2<decltype(rows)::value, decltype(panels)::value>(x, wp, y, m, p, N, K, k0, k1);
  });
}

template <typename W>
void fp32_panels_avx2(const float* x, const W* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
  const auto tile = [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
    fp32_tile_avx2<decltype(rows)::value, decltype(panels)::value>(x, wp, y, m, p, N, K, k0, k1);
  };
  panel_tiles<6, 1>(M, p0, p1, K, 16 * static_cast<int64_t>(sizeof(W)), 2, tile);
}

template void fp32_panels_avx2(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void fp32_panels_avx2(const float*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
