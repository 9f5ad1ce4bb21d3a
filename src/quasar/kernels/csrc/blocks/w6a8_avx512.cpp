// W6A8 on AVX-512 VNNI (w6a8_layout.h has the arithmetic and the layouts): vpdpbusd sums 4 products of 6-bit quants
// and int8 inputs into int32 lanes directly.
#include "w6a8_layout.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"

#include <immintrin.h>

using namespace w6a8;

QUASAR_TARGET_PUSH(QUASAR_AVX512_VNNI)
namespace {

template <int R, int C, Prefetch P>
void dpbusd_tile(const BlockCall& call, int64_t m0, int64_t p0, int64_t k0, int64_t k1) {
  const int64_t K = call.K, N = call.N, groups = K / kGroup, blocks = K / kBlock;
  const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x30);
  __m512 facc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      facc[r][c] = k0 ? _mm512_loadu_ps(call.y + (m0 + r) * N + 16 * (p0 + c)) : _mm512_setzero_ps();
  __m512 d[C];
  for (int64_t g = k0 / kGroup; g < k1 / kGroup; ++g) {
    __m512 part[R][C];
    for (int u = 0; u < 2; ++u) {  // the group's two sub-blocks
      __m512i acc[R][C];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
      for (int s = 0; s < 2; ++s) {
        const int t = 2 * u + s;
        __m512i lo[C], hi[C];
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          const uint8_t* group = call.wp + ((p0 + c) * groups + g) * kGroupBytes;
          prefetch_weights<P>(group + 64 * t);
          if (s == 0) prefetch_weights<P>(group + kHighBits + 64 * u);
          const __m512i v = _mm512_loadu_si512(group + 64 * t);
          const __m512i high = _mm512_loadu_si512(group + kHighBits + 64 * u);
          // the nibble | its 2 high bits moved to bits 4-5 (16-bit shifts, masked per byte): 0xF8 = A | (B & C)
          const __m512i bits_lo = s ? high : _mm512_slli_epi16(high, 4);
          const __m512i bits_hi = s ? _mm512_srli_epi16(high, 2) : _mm512_slli_epi16(high, 2);
          lo[c] = _mm512_ternarylogic_epi32(_mm512_and_si512(v, low), bits_lo, two, 0xF8);
          hi[c] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), bits_hi, two, 0xF8);
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = call.x + (m0 + r) * K + g * kGroup + 8 * t;
          const __m512i x0 = _mm512_set1_epi32(four_inputs(xr)), x1 = _mm512_set1_epi32(four_inputs(xr + 4));
#pragma GCC unroll 4
          for (int c = 0; c < C; ++c) acc[r][c] = dpbusd512(dpbusd512(acc[r][c], lo[c], x0), hi[c], x1);
        }
      }
      const int64_t sub = (g * kGroup % kBlock) / 16 + u;
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* block = call.sp + ((p0 + c) * blocks + g * kGroup / kBlock) * kBlockBytes;
        if (u == 0) prefetch_weights<P>(block + 32 + 16 * sub);
        if (u == 0 && (g == k0 / kGroup || sub == 0))  // a new block: its d
          d[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
        const __m512 scale = _mm512_mul_ps(d[c], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * sub)))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i offset = _mm512_set1_epi32(32 * call.xsum16[(m0 + r) * (K / 16) + 2 * g + u]);
          const __m512 sub_part = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], offset)), scale);
          part[r][c] = u ? _mm512_add_ps(part[r][c], sub_part) : sub_part;
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xs = _mm512_set1_ps(call.x_scale[(m0 + r) * groups + g]);
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) facc[r][c] = _mm512_add_ps(facc[r][c], _mm512_mul_ps(part[r][c], xs));
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(call.y + (m0 + r) * N + 16 * (p0 + c), facc[r][c]);
}

void panels(const BlockCall& call, int64_t p0, int64_t p1) {
  with_prefetch(prefetch_policy(), [&](auto policy) {
    const auto tile = [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      dpbusd_tile<decltype(rows)::value, decltype(panels)::value, decltype(policy)::value>(call, m, p, k0, k1);
    };
    if (call.M <= 2)  // decode: two panels side by side
      panel_tiles<2, 2>(call.M, p0, p1, call.K, 12, kBlock, tile);
    else  // 6 rows: 6 int32, 6 float and 6 group accumulators, 2 weight registers
      panel_tiles<6, 1>(call.M, p0, p1, call.K, 12, kBlock, tile);
  });
}

}  // namespace

void w6a8_dpbusd_panels(const BlockCall& call, int64_t p0, int64_t p1) { panels(call, p0, p1); }
QUASAR_TARGET_POP
