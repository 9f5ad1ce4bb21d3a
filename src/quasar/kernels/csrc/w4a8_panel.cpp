// W4A8: 4- and 5-bit weights with scales and mins as GGUF's Q4_0, Q4_1, Q4_K and Q5_K blocks hold them, times dynamic
// int8 activations (one scale per 32 inputs), with the weights packed in panels of 16 output channels:
//
//   w[n, k] = S[n, g] * q[n, k] - M[n, g]      q in [0, 15] (Q5_K: [0, 31]), g = k / 32 (a group)
//   S[n, g] = d[n, b] * sc[n, g],  M[n, g] = dmin[n, b] * m[n, g]      b = k / B (a block of B = 32 or 256 inputs)
//   y[m, n] = sum_g ((float(sum_{k in g} q[n, k] x[m, k]) * S[n, g] - M[n, g] * float(xsum[m, g])) * x_scale[m, g])
//
// d and dmin are float16, sc and m bytes: Q4_K's and Q5_K's super-blocks as they are (B = 256, 6-bit sc and m), and Q4_0 /
// Q4_1 with B = 32, sc = m = 1 and dmin = 8 d (Q4_0) or -min (Q4_1). S and M are exact products (11 x 8 bits), so
// the weights are exactly the file's. xsum[m, g] is the sum of the row's int8 inputs over the group; the group's
// dot product is exact in int32; then five float operations per group (no fused multiply-add, so a float32
// reference gives the same floats), each lane taking its own channel's groups in order: a row's result never
// depends on the other rows, the tile shape, the chunking of K or the instruction set.
//
//   wp [N/16][K/32][256] uint8: per group, 4 chunks of 8 inputs, each 16 channels x 4 bytes, byte j of channel c
//                               holding inputs 8t + j (low nibble) and 8t + 4 + j (high nibble); 5-bit quants
//                               ([N/16][K/32][320]) add 16 channels x 4 bytes of their fifth bits, byte j of channel
//                               c holding that of input 8t + 4h + j in bit 2t + h
//   sp [N/16][K/B][64 + B] uint8:    per block, d[16] and dmin[16] as float16, then per group sc[16] and m[16];
//                                    [N/16][K/32][64] (unit) where B = 32 and every sc and m is 1: d and dmin alone
//
// AVX-512 VNNI: vpdpbusd takes the quants (unsigned) against 4 inputs broadcast (signed), 4 inputs of 16 channels
// an instruction. AVX2: maddubs takes the same operands into int16 pairs, summed in int16 over the group for 4-bit
// quants (at most 16 * 15 * 127 < 2^15: no saturation, as |x| <= 127) and over a chunk for 5-bit ones (4 * 31 * 127),
// then madd by ones into each channel's int32 lane.
#include "block_panels.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"

#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32, kBlockHead = 64, kFifthBits = 256;

// The bytes of one group of a panel: 4-bit or 5-bit quants.
template <bool Five>
constexpr int64_t kGroupBytes = Five ? 320 : 256;

// ---- AVX2 (maddubs): a panel's 64 bytes per 8 inputs are two 256-bit registers, channels 0-7 and 8-15 ----------

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
          if constexpr (Five) acc[r] = t ? _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones)) : _mm256_madd_epi16(pairs, ones);
          else acc[r] = t ? _mm256_add_epi16(acc[r], pairs) : pairs;
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

// ---- AVX-512 VNNI (dpbusd): one 512-bit register per 16 channels x 4 inputs --------------------------------------

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

void group_sums(const int8_t* x, int64_t M, int64_t K, int64_t G, int32_t* xsum) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / G; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += x[m * K + k];
      xsum[m * (K / G) + g] = sum;
    }
}

namespace {

template <bool Five>
void panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1) {
  if (path == Int8Path::Dpbusd) return dpbusd_panels<Five>(call, p0, p1);
  with_prefetch(prefetch_policy(call.M, true), [&](auto policy) {
    const auto tile = [&](auto rows, auto, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      maddubs_tile<Five, decltype(rows)::value, decltype(policy)::value>(call, m, p, k0, k1);
    };
    // 8 rows: 8 integer sums and 2 weight registers; each group's float part is added to y in place (L1), which
    // leaves the registers to the rows (docs/kernels.md)
    panel_tiles<8, 1>(call.M, p0, p1, call.K, 8, call.B, tile);
  });
}

}  // namespace

void w4a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1) { panels<false>(path, call, p0, p1); }
void w5a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1) { panels<true>(path, call, p0, p1); }
