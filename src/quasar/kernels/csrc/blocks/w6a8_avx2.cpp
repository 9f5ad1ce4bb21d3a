// W6A8 on AVX2 (w6a8_layout.h has the arithmetic and the layouts): maddubs's int16 pairs hold 4 products of 6-bit
// quants and int8 inputs (4 * 63 * 127 < 2^15), then madd by ones into int32 lanes once per chunk.
#include "w6a8_layout.h"
#include "blocking.h"

#include <immintrin.h>

namespace {

using namespace w6a8;

// One half of a panel (8 channels, one register) at a time, as w4a8_avx2.cpp's tile: R int32 sums, the chunk's
// two quant registers and the sub-block's high bits; the empty asm statements pin each row's sum after every chunk
// (GCC otherwise reassociates the sums and spills the products).
template <int R, Prefetch P>
void maddubs_tile(const BlockCall& call, int64_t m0, int64_t p0, int64_t k0, int64_t k1) {
  const int64_t K = call.K, N = call.N, groups = K / kGroup, blocks = K / kBlock;
  const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x30), ones = _mm256_set1_epi16(1);
  if (!k0)
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(call.y + (m0 + r) * N + 16 * p0 + 8 * h, _mm256_setzero_ps());
  for (int64_t g = k0 / kGroup; g < k1 / kGroup; ++g) {
    const uint8_t* group = call.wp + (p0 * groups + g) * kGroupBytes;
    const uint8_t* block = call.sp + (p0 * blocks + g * kGroup / kBlock) * kBlockBytes;
    for (int c = 0; c < kGroupBytes / 64; ++c) prefetch_weights<P>(group + 64 * c);
    const int64_t first_sub = (g * kGroup % kBlock) / 16;
    if (first_sub == 0) prefetch_weights<P>(block + 32);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * h)));
      __m256 part[R];
      for (int u = 0; u < 2; ++u) {  // the group's two sub-blocks
        __m256i acc[R];
        const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + kHighBits + 64 * u + 32 * h));
        for (int s = 0; s < 2; ++s) {
          const int t = 2 * u + s;
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + 64 * t + 32 * h));
          const __m256i bits_lo = s ? _mm256_and_si256(high, two) : _mm256_and_si256(_mm256_slli_epi16(high, 4), two);
          const __m256i bits_hi = s ? _mm256_and_si256(_mm256_srli_epi16(high, 2), two)
                                    : _mm256_and_si256(_mm256_slli_epi16(high, 2), two);
          const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low), bits_lo);
          const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), bits_hi);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) {
            const int8_t* xr = call.x + (m0 + r) * K + g * kGroup + 8 * t;
            const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_inputs(xr))),
                                                   _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_inputs(xr + 4))));
            acc[r] = s ? _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones)) : _mm256_madd_epi16(pairs, ones);
            __asm__("" : "+x"(acc[r]));
          }
        }
        const int64_t sub = first_sub + u;
        const __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 32 + 16 * sub + 8 * h)))));
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m256i offset = _mm256_set1_epi32(32 * call.xsum16[(m0 + r) * (K / 16) + 2 * g + u]);
          const __m256 sub_part = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[r], offset)), scale);
          part[r] = u ? _mm256_add_ps(part[r], sub_part) : sub_part;
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(call.x_scale[(m0 + r) * groups + g]);
        float* out = call.y + (m0 + r) * N + 16 * p0 + 8 * h;
        _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), _mm256_mul_ps(part[r], xs)));
      }
    }
  }
}

}  // namespace

void w6a8_maddubs_panels(const BlockCall& call, int64_t p0, int64_t p1) {
  with_prefetch(prefetch_policy(call.M, true), [&](auto policy) {
    const auto tile = [&](auto rows, auto, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      maddubs_tile<decltype(rows)::value, decltype(policy)::value>(call, m, p, k0, k1);
    };
    panel_tiles<6, 1>(call.M, p0, p1, call.K, 12, kBlock, tile);  // 6 rows, y as the float accumulator (w4a8_avx2.cpp)
  });
}
