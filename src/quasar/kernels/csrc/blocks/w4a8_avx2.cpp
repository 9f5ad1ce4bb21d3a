// W4A8 on AVX2 (w4a8_layout.h has the arithmetic and the layouts): maddubs takes the quants (unsigned) against 4
// inputs broadcast (signed) into int16 pairs, summed in int16 over the group for 4-bit quants (at most 16 * 15 * 127
// < 2^15: no saturation, as |x| <= 127) and over a chunk for 5-bit ones (4 * 31 * 127), then madd by ones into each
// channel's int32 lane.
#include "w4a8_layout.h"
#include "blocking.h"

#include <immintrin.h>

namespace {

using namespace w4a8;

// Bit `bit` of each byte of v at bit 4 (16-bit shifts: the other bits are garbage, masked by the caller).
inline __m256i to_bit4(__m256i v, int bit) {
  if (bit < 4) return _mm256_slli_epi16(v, 4 - bit);
  if (bit > 4) return _mm256_srli_epi16(v, bit - 4);
  return v;
}

// One half of a panel (8 channels, one register) at a time: R int16 (4-bit) or int32 (5-bit) sums and the two
// registers of a chunk's quants, so 8 rows fit the 16 registers. The empty asm statements pin each row's sum after
// every chunk: without them GCC reassociates the integer sums, computes all products of a group first and spills
// them (50 instructions for the 8 channels x 32 inputs of a row, against 40).
template <bool Five, int R, Prefetch P>
void maddubs_tile(const BlockCall& call, int64_t m0, int64_t p0, int64_t k0, int64_t k1) {
  const auto [x, xsum, xsum16, x_scale, wp, sp, B, unit, y, M, N, K] = call;  // by value: no aliasing
  const int64_t groups = K / kGroup, per = B / kGroup, blocks = K / B, block_bytes = kBlockHead + (unit ? 0 : B);
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  if (!k0)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + r) * N + 16 * p0 + 8 * h, _mm256_setzero_ps());
  for (int64_t g = k0 / kGroup; g < k1 / kGroup; ++g) {
    const uint8_t* group = wp + (p0 * groups + g) * kGroupBytes<Five>;
    for (int t = 0; t < 4; ++t) prefetch_weights<P>(group + 64 * t);
    if constexpr (Five) prefetch_weights<P>(group + kFifthBits);
    const uint8_t* block = sp + (p0 * blocks + g / per) * block_bytes;
    const uint8_t* scales = block + kBlockHead + kGroup * (g % per);
    prefetch_weights<P>(unit ? block : scales);
    for (int h = 0; h < 2; ++h) {
      __m256i acc[R];
      __m256i fifth;
      if constexpr (Five) fifth = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kFifthBits + 32 * h));
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 64 * t + 32 * h));
        __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        if constexpr (Five) {  // nibble | bit 2t (+ 1) of each byte moved to bit 4 (16-bit shifts, masked per byte)
          const __m256i bit4 = _mm256_set1_epi8(0x10);
          lo = _mm256_or_si256(lo, _mm256_and_si256(to_bit4(fifth, 2 * t), bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(to_bit4(fifth, 2 * t + 1), bit4));
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x + (m0 + r) * K + g * kGroup + 8 * t;
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_inputs(xr))),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_inputs(xr + 4))));
          if constexpr (Five) {
            const __m256i sums = _mm256_madd_epi16(pairs, ones);
            acc[r] = t ? _mm256_add_epi32(acc[r], sums) : sums;
          } else {
            acc[r] = t ? _mm256_add_epi16(acc[r], pairs) : pairs;
          }
          __asm__("" : "+x"(acc[r]));
        }
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * h)));
      const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 32 + 16 * h)));
      __m256 s = d, mn = dmin;  // unit: d * 1 and dmin * 1, the same floats
      if (!unit) {
        s = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 8 * h)))));
        mn = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                                     _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + 16 + 8 * h)))));
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(x_scale[(m0 + r) * groups + g]);
        const __m256 sums = _mm256_set1_ps(static_cast<float>(xsum[(m0 + r) * groups + g]));
        const __m256 dot = _mm256_cvtepi32_ps(Five ? acc[r] : _mm256_madd_epi16(acc[r], ones));
        const __m256 part = _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(dot, s), _mm256_mul_ps(mn, sums)), xs);
        float* out = y + (m0 + r) * N + 16 * p0 + 8 * h;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), part));
      }
    }
  }
}

}  // namespace

void w4a8_maddubs_panels(bool five, const BlockCall& call, int64_t p0, int64_t p1) {
  with_prefetch(prefetch_policy(call.M, true), [&](auto policy) {
    const auto tile = [&](auto rows, auto, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      if (five) maddubs_tile<true, decltype(rows)::value, decltype(policy)::value>(call, m, p, k0, k1);
      else maddubs_tile<false, decltype(rows)::value, decltype(policy)::value>(call, m, p, k0, k1);
    };
    // 8 rows: 8 integer sums and 2 weight registers; each group's float part is added to y in place (L1), which
    // leaves the registers to the rows (docs/kernels.md)
    panel_tiles<8, 1>(call.M, p0, p1, call.K, 8, call.B, tile);
  });
}
