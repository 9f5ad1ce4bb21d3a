// Group-wise W8A8 on AVX-512 VNNI with the weights packed in panels of 16 output channels (the dpbusd path's
// layout for every group-wise linear whose N is a multiple of 16):
//
//   wp [N/16][K/4][16][4] uint8 = w + 128 (16 channels x 4 inputs per 64-byte register), wsp [N/16][K/G][16]
//   y[m, n] = sum_g (w_scale[n, g] * x_scale[m, g]) * sum_{k in g} q[m, k] * w[n, k]
//
// vpdpbusd multiplies unsigned by signed bytes: here the weights are the unsigned operand (w + 128, made once
// at load) and a row's 4 quantized inputs, broadcast, the signed one, so one instruction accumulates 4 inputs
// of 16 channels, and sum (w + 128) q = sum w q + 128 sum q: a group's lanes start at -128 * (the row's sum
// of q over the group), computed once per call and row, and end at the exact int32 dot. Then one conversion
// and one fused multiply-add per group, row and 16 channels. Each lane takes its own channel's groups in
// order, so a row's result never depends on the other rows, the tile shape or the chunking of K.
//
// Tiles of R rows x C panels keep R x C int32 and float32 accumulators in registers: a weight load serves R
// rows, a broadcast input C panels, and the chains of vpdpbusd (latency ~5 cycles) run R x C side by side.
// Panels go in blocks and K in chunks of whole groups (blocking.h), the partial sums kept in y between
// chunks (a float stored and loaded is the same float).
#include "int8_dot.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"

#include <immintrin.h>
#include <cstring>

QUASAR_TARGET_PUSH(QUASAR_AVX512_VNNI)
namespace {

// Rows m0.. (R) times panels p0.. (C) over inputs [k0, k1) (whole groups). start [M, K/G] int32 = -128 * the
// group sums of q; x_scale [M, K/G].
template <int R, int C, Prefetch P>
void panel_tile(const int8_t* q, const int32_t* start, const float* x_scale, const uint8_t* wp, const float* wsp,
                float* y, int64_t m0, int64_t p0, int64_t N, int64_t K, int64_t G, int64_t k0, int64_t k1) {
  const int64_t groups = K / G;
  __m512 facc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) facc[r][c] = k0 ? _mm512_loadu_ps(y + (m0 + r) * N + 16 * (p0 + c)) : _mm512_setzero_ps();
  for (int64_t g = k0 / G; g < k1 / G; ++g) {
    __m512i acc[R][C];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512i s = _mm512_set1_epi32(start[(m0 + r) * groups + g]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) acc[r][c] = s;
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 4) {
      __m512i wv[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* panel = wp + ((p0 + c) * K + k) * 16;
        prefetch_weights<P>(panel);
        wv[c] = _mm512_loadu_si512(panel);
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, q + (m0 + r) * K + k, sizeof four);
        const __m512i xv = _mm512_set1_epi32(four);
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = dpbusd512(acc[r][c], wv[c], xv);
      }
    }
    __m512 ws[C];
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) ws[c] = _mm512_loadu_ps(wsp + ((p0 + c) * groups + g) * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(x_scale[(m0 + r) * groups + g]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c)
        facc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), _mm512_mul_ps(ws[c], xs), facc[r][c]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + (m0 + r) * N + 16 * (p0 + c), facc[r][c]);
}

}  // namespace

void int8_panel_dot(const int8_t* q, const int32_t* start, const float* x_scale, const uint8_t* wp, const float* wsp,
                    float* out, int64_t M, int64_t N, int64_t K, int64_t G, int64_t n0, int64_t n1) {
  const int64_t p0 = (n0 + 15) / 16, p1 = (n1 + 15) / 16;  // the panels that start in [n0, n1)
  with_prefetch(prefetch_policy(), [&](auto policy) {
    const auto tile = [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      panel_tile<decltype(rows)::value, decltype(panels)::value, decltype(policy)::value>(q, start, x_scale, wp, wsp, out,
                                                                                       m, p, N, K, G, k0, k1);
    };
    if (M <= 2)  // decode: more panels side by side for more independent chains
      panel_tiles<2, 4>(M, p0, p1, K, 16, G, tile);
    else
      panel_tiles<6, 2>(M, p0, p1, K, 16, G, tile);
  });
}
QUASAR_TARGET_POP

void group_starts(const int8_t* q, int64_t M, int64_t K, int64_t G, int32_t* start) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / G; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += q[m * K + k];
      start[m * (K / G) + g] = -128 * sum;
    }
}
