// W6A8: Q6_K's 6-bit weights as the GGUF file holds them, times dynamic int8 activations (one scale per 32 inputs),
// with the weights packed in panels of 16 output channels:
//
//   w[n, k] = S[n, s] * (q[n, k] - 32)    q in [0, 63], s = k / 16 (a sub-block), S[n, s] = d[n, k / 256] * sc[n, s]
//   y[m, n] = sum_g (float(D[a]) * S[n, a] + float(D[b]) * S[n, b]) * x_scale[m, g]
//             D[s] = sum_{k in s} q[n, k] x[m, k] - 32 * xsum16[m, s]     a, b: group g's two sub-blocks
//
// d is float16, sc a signed byte (S is exact: 11 x 8 bits), so the weights are exactly the file's; D is exact in
// int32; then four float operations per group and one to accumulate (no fused multiply-add), each lane taking its
// own channel's groups in order, as w4a8_panel.cpp's.
//
//   wp [N/16][K/32][384] uint8: per group, the low 4 bits of q as w4a8_panel.cpp packs its quants (4 chunks of 8
//        inputs, 16 channels x 4 bytes), then the high 2 bits in two 64-byte vectors, one per sub-block u: byte j of
//        channel c holds those of inputs 16u + j, 16u + 4 + j, 16u + 8 + j and 16u + 12 + j, two bits each from bit 0
//   sp [N/16][K/256][288] uint8: per block of 256 inputs, d[16] as float16, then sc[16] for each of its 16 sub-blocks
//
// Products of 6-bit quants and int8 inputs: maddubs's int16 pairs hold 4 of them (4 * 63 * 127 < 2^15), then madd
// by ones into int32 lanes once per chunk; vpdpbusd sums 4 into int32 lanes directly.
#include "block_panels.h"
#include "blocking.h"
#include "vnni.h"
#include "targets.h"

#include <immintrin.h>

namespace {

constexpr int64_t kGroup = 32, kGroupBytes = 384, kHighBits = 256, kBlock = 256, kBlockBytes = 32 + 256;

// ---- AVX2 (maddubs): a panel's 64 bytes per 8 inputs are two 256-bit registers, channels 0-7 and 8-15 ----------

// One half of a panel (8 channels, one register) at a time, as w4a8_panel.cpp's AVX2 tile: R int32 sums, the chunk's
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

// ---- AVX-512 VNNI (dpbusd): one 512-bit register per 16 channels x 4 inputs --------------------------------------

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

void dpbusd_panels(const BlockCall& call, int64_t p0, int64_t p1) {
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
QUASAR_TARGET_POP

void w6a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1) {
  if (path == Int8Path::Dpbusd) return dpbusd_panels(call, p0, p1);
  with_prefetch(prefetch_policy(call.M, true), [&](auto policy) {
    const auto tile = [&](auto rows, auto, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      maddubs_tile<decltype(rows)::value, decltype(policy)::value>(call, m, p, k0, k1);
    };
    panel_tiles<6, 1>(call.M, p0, p1, call.K, 12, kBlock, tile);  // 6 rows, y as the float accumulator (w4a8_panel.cpp)
  });
}
