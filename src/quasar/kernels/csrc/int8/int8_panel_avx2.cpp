// Group-wise W8A8 on AVX2 with the weights packed in panels of 16 output channels (int8_panel_avx512.cpp has the
// dpbusd path's panels, whose arithmetic this one follows):
//
//   wp [N/16][K/4][16][4] int8 = w (signed), wsp [N/16][K/G][16]: a panel's 64 bytes per 4 inputs are two
//   256-bit registers, channels 0-7 and 8-15. maddubs multiplies |w| (unsigned) by the row's 4 inputs,
//   broadcast, with w's sign (sign_epi8), pairs summed in int16 (at most 2 * 128 * 127 < 2^15: no saturation,
//   as |q| <= 127), then madd by ones sums each channel's 4 products into its int32 lane. |w| is taken once
//   per weight register for all R rows. A group's int32 sums are exact, then each lane takes
//   fmadd(float(sum), w_scale * x_scale, acc) per group in order: the dpbusd panels' arithmetic, so both give
//   the same floats. Against the channel-by-channel loop of int8_group_avx2.cpp this takes the conversion and the
//   scaling once per 8 channels and group instead of once per channel and group: 4 instructions per 32
//   products and row instead of 6-7, where the AVX2 loop is bound by instructions at 6 rows.
#include "int8_dot.h"
#include "blocking.h"

#include <immintrin.h>
#include <cstring>

namespace {

template <int R, Prefetch P>
void maddubs_panel_tile(const int8_t* q, const float* x_scale, const int8_t* wp, const float* wsp, float* y,
                        int64_t m0, int64_t p0, int64_t N, int64_t K, int64_t G, int64_t k0, int64_t k1) {
  constexpr int H = 2;  // a panel's two 256-bit halves: 8 channels each
  const int64_t groups = K / G;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = k0 / G; g < k1 / G; ++g) {
    __m256i acc[R][H];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_si256();
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      __m256i wv[H], aw[H];
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) {
        const int8_t* half = wp + (p0 * K + k) * 16 + 32 * h;
        if (h == 0) prefetch_weights<P>(half);
        wv[h] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(half));
        aw[h] = _mm256_abs_epi8(wv[h]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, q + (m0 + r) * K + k, sizeof four);
        const __m256i xv = _mm256_set1_epi32(four);
#pragma GCC unroll 8
        for (int h = 0; h < H; ++h)
          acc[r][h] = _mm256_add_epi32(acc[r][h], _mm256_madd_epi16(_mm256_maddubs_epi16(aw[h], _mm256_sign_epi8(xv, wv[h])), ones));
      }
    }
    // The float sums live in y between groups (16 registers hold the int32 sums and the weights, not both):
    // a float stored and loaded is the same float.
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      const __m256 ws = _mm256_loadu_ps(wsp + (p0 * groups + g) * 16 + 8 * h);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* out = y + (m0 + r) * N + 16 * p0 + 8 * h;
        const __m256 sum = g == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out);
        const __m256 xs = _mm256_set1_ps(x_scale[(m0 + r) * groups + g]);
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(ws, xs), sum));
      }
    }
  }
}

}  // namespace

void int8_panel_dot_maddubs(const int8_t* q, const float* x_scale, const int8_t* wp, const float* wsp, float* out,
                            int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t p0 = (n0 + 15) / 16, p1 = (n1 + 15) / 16;  // the panels that start in [n0, n1)
  with_prefetch(prefetch_policy(M, true), [&](auto policy) {
    const auto tile = [&](auto rows, auto, int64_t m, int64_t p, int64_t k0, int64_t k1) {  // one panel per tile
      maddubs_panel_tile<decltype(rows)::value, decltype(policy)::value>(
          q, x_scale, wp, wsp, out, m, p, N, K, G, k0, k1);
    };
    if (M <= 1)  // one panel at a time: wider tiles measured slower at 1 row
      panel_tiles<1, 1>(M, p0, p1, K, 16, G, tile);
    else  // 4 rows: their 8 int32 sums, 2 weight registers and their absolute values fill the 16 registers
      panel_tiles<4, 1>(M, p0, p1, K, 16, G, tile);
  });
}
