// Float-activation linears: y [M, N] = x [M, K] . w [N, K]^T (* scale[n]) (+ bias[n]), float32 sums in one
// fixed order per output, whatever the instruction set and however many rows come together. Three products:
//
// - float_act_linear: float32 x times plain [N, K] bfloat16, int8 (W8A16, with a per-channel scale) or
//   float32 weights, widened to float32 in registers (a shape the packed products do not take). An
//   output is 16 lanes, lane j summing the k = j (mod 16) in k order with FMAs, then hsum8x2(lanes 0-7,
//   lanes 8-15). AVX2 keeps the 16 lanes in two registers, AVX-512 in one: the same float either way.
// - bf16_linear: x rounded to bfloat16 (to nearest even, as torch's x.to(torch.bfloat16)) times bfloat16
//   weights packed in panels of 16 channels ([N/16][K/2][16][2]: each channel's input pairs side by side),
//   float32 sums: the bf16 verifier (as llama.cpp runs a BF16 model). An output is one float32 lane that
//   takes the input pairs in order, the odd element first: exactly AVX512-BF16's vdpbf16ps with the pair of
//   x broadcast (16 channels per instruction, no lane sums at the end). The avx512 and avx2 paths run the
//   same sums as two FMAs per pair, on 16 and 8 channels: a product of two bfloat16 is exact in float32, so
//   each FMA rounds once, as vdpbf16ps does, and with denormals flushed to zero as vdpbf16ps flushes them.
//   Where the CPU has vdpbf16ps a probe picks the faster of it and the 16-lane FMAs (pair_fma_faster).
//   Where it has AMX-BF16 the "amx" path runs bf16_linear on the tile unit instead (float_amx.cpp), 6-7x the
//   FMAs' rate at a prefill's 1,024 rows: its sums are tdpbf16ps's, not vdpbf16ps's (other floats, as close
//   to the exact sum), so it is a path of its own, still with every row independent of the others. Its
//   other products (and a K that is no multiple of 32) run as on the avx512 path.
// - fp32_linear: float32 x times weights packed in panels of 16 channels ([N/16][K][16]), float32 (the fp32
//   verifier) or bfloat16 widened to float32 in registers (exact: the floats of the same weights stored as
//   float32, in half the bytes; the bf16 lm_head of W8A8 checkpoints). An output is one float32 FMA chain in
//   k order, on 16 channels per AVX-512 register or 8 per AVX2.
//
// All are tiled: R rows x C channels (or panels) of accumulators in registers, so each weight load serves R
// rows and each activation load C channels, and a thread walks its channels in blocks small enough to stay
// in L2 while every row passes: a prefill of many rows reads each weight from memory once. The packed ones also
// walk K in chunks, keeping its partial sums in y between them (a float stored and loaded is the same
// float, so the chunks change no result).
//
// The instruction sets' loops: float_dot_avx2.cpp (AVX2), float_dot_avx512.cpp (AVX-512 float32 lanes and
// AVX512-BF16's vdpbf16ps) and float_amx.cpp (AMX tiles); this header has the helpers they share, the rounding of x
// to bfloat16 that every path's bf16_linear takes, and the loops' entry points; float_dot.cpp picks one per call.
#pragma once
#include "blocking.h"

#include <immintrin.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace float_dot {

// The weights of one block of channels: small enough to stay in L2 while every row tile passes.
constexpr int64_t kBlockBytes = 256 * 1024;

// Rows [0, M) times channels [n0, n1) in tiles of at most RMAX rows x CMAX channels: tile(rows, cols, m, n),
// rows and cols std::integral_constant, so each tile shape gets its own unrolled kernel.
template <int RMAX, int CMAX, typename F>
void tiles(int64_t M, int64_t n0, int64_t n1, int64_t row_bytes, F tile) {
  const int64_t block = std::max<int64_t>(CMAX, kBlockBytes / std::max<int64_t>(row_bytes, 1) / CMAX * CMAX);
  for (int64_t b = n0; b < n1; b += block) {
    const int64_t b1 = std::min(b + block, n1);
    row_blocks<RMAX>(M, [&](auto rows, int64_t m) {
      row_blocks<CMAX>(b1 - b, [&](auto cols, int64_t c) { tile(rows, cols, m, b + c); });
    });
  }
}

template <typename W>
inline void prefetch_row(const W* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p) + kPrefetch, _MM_HINT_T0);
}

inline int32_t pair_at(const uint16_t* p) {  // two bfloat16 as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// x [count] float32 rounded to bfloat16, to nearest even (NaN stays a quiet NaN): torch's rounding, 8 at a time.
// Out: the bfloat16 bits (uint16_t), or the same numbers as float32 (float).
template <typename Out>
void round_bf16(const float* x, int64_t count, Out* out) {
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), nan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 f = _mm256_loadu_ps(x + i);
    const __m256i v = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(v, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(v, _mm256_add_epi32(half, lsb)), 16);
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    if constexpr (std::is_same_v<Out, float>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_slli_epi32(r, 16));
    } else {
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // 8 uint16 in the low half
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
    }
  }
  for (; i < count; ++i) {
    uint32_t v;
    std::memcpy(&v, x + i, sizeof v);
    const uint16_t bits = x[i] != x[i] ? 0x7FC0 : static_cast<uint16_t>((v + 0x7FFF + ((v >> 16) & 1)) >> 16);
    if constexpr (std::is_same_v<Out, float>) {
      const uint32_t widened = static_cast<uint32_t>(bits) << 16;
      std::memcpy(out + i, &widened, sizeof widened);
    } else {
      out[i] = bits;
    }
  }
}

}  // namespace float_dot

// Channels [n0, n1) of float_act_dot's y [M, N] (before its scale and bias) on one instruction set: w [N, K]
// float32, int8 or bfloat16 bits (uint16_t).
template <typename W>
void act32_avx2(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1);
template <typename W>
void act32_avx512(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1);

// Panels [p0, p1) of packed_dot's y [M, N] (before its bias) on one instruction set. bf16_linear: w [N/16, K/2, 16, 2]
// bfloat16 pairs times x rounded to bfloat16, as bits (avx2, vdpbf16ps) or as float32 numbers (the avx512 FMAs),
// with denormals flushed by the caller except for vdpbf16ps (which flushes them itself). fp32_linear: w [N/16, K, 16]
// float32 or bfloat16 bits (widened), x float32.
void bf16_panels_avx2(const uint16_t* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                      int64_t p1);
void bf16_panels_avx512(const float* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                        int64_t p1);
void bf16_panels_avx512bf16(const uint16_t* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K,
                            int64_t p0, int64_t p1);
template <typename W>
void fp32_panels_avx2(const float* x, const W* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1);
template <typename W>
void fp32_panels_avx512(const float* x, const W* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                        int64_t p1);
