// W4A8 on AVX-512 VNNI (w4a8_layout.h has the arithmetic and the layouts): vpdpbusd takes the quants (unsigned)
// against 4 inputs broadcast (signed), 4 inputs of 16 channels an instruction.
#include "w4a8_layout.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"

#include <immintrin.h>

using namespace w4a8;

QUASAR_TARGET_PUSH(QUASAR_AVX512_VNNI)
namespace {

// Bit `bit` of each byte of v at bit 4 (16-bit shifts: the other bits are garbage, masked by the caller).
inline __m512i to_bit4(__m512i v, int bit) {
  if (bit < 4) return _mm512_slli_epi16(v, 4 - bit);
  if (bit > 4) return _mm512_srli_epi16(v, bit - 4);
  return v;
}

template <bool Five, int R, int C, Prefetch P>
void dpbusd_tile(const BlockCall& call, int64_t m0, int64_t p0, int64_t k0, int64_t k1) {
  const auto [x, xsum, xsum16, x_scale, wp, sp, B, unit, y, M, N, K] = call;  // by value: no aliasing
  const int64_t groups = K / kGroup, per = B / kGroup, blocks = K / B, block_bytes = kBlockHead + (unit ? 0 : B);
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 facc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) facc[r][c] = k0 ? _mm512_loadu_ps(y + (m0 + r) * N + 16 * (p0 + c)) : _mm512_setzero_ps();
  for (int64_t g = k0 / kGroup; g < k1 / kGroup; ++g) {
    __m512i acc[R][C];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_si512();
    __m512i fifth[C];
    if constexpr (Five) {
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* group = wp + ((p0 + c) * groups + g) * kGroupBytes<Five>;
        prefetch_weights<P>(group + kFifthBits);
        fifth[c] = _mm512_loadu_si512(group + kFifthBits);
      }
    }
    for (int t = 0; t < 4; ++t) {
      __m512i lo[C], hi[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const uint8_t* group = wp + ((p0 + c) * groups + g) * kGroupBytes<Five>;
        prefetch_weights<P>(group + 64 * t);
        const __m512i v = _mm512_loadu_si512(group + 64 * t);
        lo[c] = _mm512_and_si512(v, low);
        hi[c] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        if constexpr (Five) {  // nibble | bit 2t (+ 1) of each byte moved to bit 4: 0xF8 = A | (B & C)
          const __m512i bit4 = _mm512_set1_epi8(0x10);
          lo[c] = _mm512_ternarylogic_epi32(lo[c], to_bit4(fifth[c], 2 * t), bit4, 0xF8);
          hi[c] = _mm512_ternarylogic_epi32(hi[c], to_bit4(fifth[c], 2 * t + 1), bit4, 0xF8);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x + (m0 + r) * K + g * kGroup + 8 * t;
        const __m512i x0 = _mm512_set1_epi32(four_inputs(xr)), x1 = _mm512_set1_epi32(four_inputs(xr + 4));
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) acc[r][c] = dpbusd512(dpbusd512(acc[r][c], lo[c], x0), hi[c], x1);
      }
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const uint8_t* block = sp + ((p0 + c) * blocks + g / per) * block_bytes;
      const uint8_t* scales = block + kBlockHead + kGroup * (g % per);
      prefetch_weights<P>(unit ? block : scales);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
      const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
      __m512 s = d, mn = dmin;  // unit: d * 1 and dmin * 1, the same floats
      if (!unit) {
        s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)))));
        mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16)))));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(x_scale[(m0 + r) * groups + g]);
        const __m512 sums = _mm512_set1_ps(static_cast<float>(xsum[(m0 + r) * groups + g]));
        const __m512 part =
            _mm512_mul_ps(_mm512_sub_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][c]), s), _mm512_mul_ps(mn, sums)), xs);
        facc[r][c] = _mm512_add_ps(facc[r][c], part);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + (m0 + r) * N + 16 * (p0 + c), facc[r][c]);
}

template <bool Five>
void dpbusd_panels(const BlockCall& call, int64_t p0, int64_t p1) {
  with_prefetch(prefetch_policy(), [&](auto policy) {
    const auto tile = [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      dpbusd_tile<Five, decltype(rows)::value, decltype(panels)::value, decltype(policy)::value>(call, m, p, k0, k1);
    };
    if (call.M <= 2)  // decode: more panels side by side for more independent chains
      panel_tiles<2, 4>(call.M, p0, p1, call.K, 8, call.B, tile);
    else  // 6 x 2 tiles: 12 int32 and 12 float accumulators, 4 weight registers
      panel_tiles<6, 2>(call.M, p0, p1, call.K, 8, call.B, tile);
  });
}

}  // namespace
QUASAR_TARGET_POP

void w4a8_dpbusd_panels(bool five, const BlockCall& call, int64_t p0, int64_t p1) {
  if (five) dpbusd_panels<true>(call, p0, p1);
  else dpbusd_panels<false>(call, p0, p1);
}
