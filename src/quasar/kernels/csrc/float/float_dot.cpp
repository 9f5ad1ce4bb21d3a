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
#include "kernel_ops.h"
#include "blocking.h"
#include "simd_lanes.h"
#include "float_amx.h"
#include "cpu.h"
#include "targets.h"
#include <immintrin.h>
#include <algorithm>
#include <cstring>
#include <memory>
#include <type_traits>

namespace {

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

// ---- AVX2 -----------------------------------------------------------------------------------------

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

inline int32_t pair_at(const uint16_t* p) {  // two bfloat16 as one 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
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

// vdpbf16ps treats denormal inputs as zero and flushes denormal results to zero: the FMAs that stand in for
// it do the same while this lives (DAZ and FTZ in this thread's MXCSR, restored after).
struct FlushDenormals {
  const unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

}  // namespace

// ---- AVX-512 (float32 lanes) and AVX512-BF16 (vdpbf16ps) ---------------------------------------------
// Each in a target region, so the templates are compiled for that instruction set (see dpbusd_path.h).

QUASAR_TARGET_PUSH(QUASAR_AVX512)
namespace avx512 {
namespace {

inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline __m512 widen16(const uint16_t* p) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// R <= 4, C <= 4: 16 accumulators, 4 activations and a weight of the 32 registers.
template <int R, int C, typename W>
void act32_tile(const float* x, const W* w, float* y, int64_t m0, int64_t n0, int64_t N, int64_t K) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + (m0 + r) * K + k);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      prefetch_row(w + (n0 + c) * K + k);
      const __m512 wv = widen16(w + (n0 + c) * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv, xv[r], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = hsum16(acc[r][c]);
}

template <typename W>
void act32(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  const auto tile = [&](auto rows, auto cols, int64_t m, int64_t n) {
    act32_tile<decltype(rows)::value, decltype(cols)::value>(x, w, y, m, n, N, K);
  };
  if (M <= 2)  // memory-bound: one weight row at a time streams fastest
    tiles<2, 1>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), tile);
  else
    tiles<4, 4>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), tile);
}

// Float32 x times float32 (or bfloat16, widened) weights packed [N/16][K][16], 16 channels a register,
// x[m, k] broadcast.
template <typename WeightT>
struct Fp32Lanes {
  using X = float;
  using T = WeightT;
  using W = __m512;
  static constexpr int64_t kStep = 1;
  static W weights(const T* panel) { return widen16(panel); }
  static __m512 input(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 madd(__m512 acc, __m512 x, W w) { return _mm512_fmadd_ps(x, w, acc); }
};

// Bfloat16 pairs by two float32 FMAs each, 16 channels a register: vdpbf16ps's arithmetic on CPUs where it
// is missing, or where two FMAs outrun it (pair_fma_faster). x holds the inputs already rounded to bfloat16,
// as float32; a weight pair's odd element is its lane's high half (mask), the even one the low half shifted
// up. R <= 6, C <= 3: 18 accumulators, 6 weights, the two inputs of a row.
template <int R, int C>
void pair_fma_tile(const float* x, const uint16_t* wp, float* y, int64_t m0, int64_t p0, int64_t N, int64_t K,
                   int64_t k0, int64_t k1) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[R][C];
#pragma GCC unroll 18
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = k0 ? _mm512_loadu_ps(y + (m0 + r) * N + 16 * (p0 + c)) : _mm512_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    __m512 w_odd[C], w_even[C];
#pragma GCC unroll 3
    for (int c = 0; c < C; ++c) {
      const uint16_t* panel = wp + (p0 + c) * K * 16 + k * 16;
      prefetch_row(panel);
      const __m512i v = _mm512_loadu_si512(panel);
      w_odd[c] = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      w_even[c] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 x_odd = _mm512_set1_ps(x[(m0 + r) * K + k + 1]), x_even = _mm512_set1_ps(x[(m0 + r) * K + k]);
#pragma GCC unroll 3
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(x_even, w_even[c], _mm512_fmadd_ps(x_odd, w_odd[c], acc[r][c]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(y + (m0 + r) * N + 16 * (p0 + c), acc[r][c]);
}

void pair_fma_dot(const float* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0, int64_t p1) {
  panel_tiles<6, 3>(M, p0, p1, K, 32, 2, [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
    pair_fma_tile<decltype(rows)::value, decltype(panels)::value>(x, wp, y, m, p, N, K, k0, k1);
  });
}

namespace fp32 {
using P = Fp32Lanes<float>;
#include "panel_tile.h"
}  // namespace fp32

namespace widened {
using P = Fp32Lanes<uint16_t>;
#include "panel_tile.h"
}  // namespace widened

}  // namespace

}  // namespace avx512
QUASAR_TARGET_POP

QUASAR_TARGET_PUSH(QUASAR_AVX512_BF16)
namespace avx512bf16 {
namespace {

// Bfloat16 pairs: 16 channels' input pairs a register, the pair of x broadcast, one vdpbf16ps per step.
struct Bf16Pairs {
  using X = uint16_t;
  using T = uint16_t;
  using W = __m512bh;
  static constexpr int64_t kStep = 2;
  static W weights(const uint16_t* panel) { return (__m512bh)_mm512_loadu_si512(panel); }
  static __m512bh input(const uint16_t* x) { return (__m512bh)_mm512_set1_epi32(pair_at(x)); }
  static __m512 madd(__m512 acc, __m512bh x, W w) { return _mm512_dpbf16_ps(acc, x, w); }
};

using P = Bf16Pairs;
#include "panel_tile.h"

}  // namespace

}  // namespace avx512bf16
QUASAR_TARGET_POP

namespace {

template <typename W>
void act32_dot(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  const FloatPath path = current_float_path();
  parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (path != FloatPath::Avx2) return avx512::act32(x, w, y, M, N, K, n0, n1);
    const auto tile = [&](auto rows, auto cols, int64_t m, int64_t n) {
      act32_tile_avx2<decltype(rows)::value, decltype(cols)::value>(x, w, y, m, n, N, K);
    };
    if (M <= 2)  // as avx512::act32
      tiles<2, 1>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), tile);
    else
      tiles<3, 2>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), tile);
  });
}

// y [M, N] = (y * scale[n]) + bias[n], each step rounded to float32 (scale, bias may be null).
void epilogue(float* y, int64_t M, int64_t N, const float* sp, const float* bp) {
  if (!sp && !bp) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float v = y[m * N + n];
      if (sp) v = v * sp[n];
      if (bp) v = v + bp[n];
      y[m * N + n] = v;
    }
}

}  // namespace

void float_act_dot(const float* x, const void* w, WeightType type, const float* scale, const float* bias, float* y,
                   int64_t M, int64_t N, int64_t K) {
  if (type == WeightType::Int8)
    act32_dot(x, static_cast<const int8_t*>(w), y, M, N, K);
  else if (type == WeightType::Float32)
    act32_dot(x, static_cast<const float*>(w), y, M, N, K);
  else
    act32_dot(x, static_cast<const uint16_t*>(w), y, M, N, K);
  epilogue(y, M, N, scale, bias);
}

namespace {

// Whether the bf16 products of the current path take x rounded as float32 numbers (the avx512 path's FMAs) rather
// than as bfloat16 bits (the tiles, vdpbf16ps, AVX2): the amx path's tiles take K in whole tiles only.
bool amx_takes(int64_t K) { return current_float_path() == FloatPath::Amx && K % 32 == 0; }
bool rounded_as_float(int64_t K) { return !amx_takes(K) && lanes_path() == FloatPath::Avx512; }

}  // namespace

void packed_dot(const void* x, const void* w, bool pairs, bool bf16, const float* bias, float* yp, int64_t M, int64_t N,
                int64_t K) {
  const int64_t P = N / 16;
  const bool widened = !pairs && bf16;
  // The amx path's tiles take bf16 pairs where K is whole tiles; what they do not take runs as on the avx512 path.
  const bool amx = pairs && amx_takes(K);
  const FloatPath path = lanes_path();
  // x rounded to bfloat16: as float32 for the AVX-512 FMAs, as bfloat16 bits for the tiles, vdpbf16ps and AVX2
  const float* xf = pairs && rounded_as_float(K) ? static_cast<const float*>(x) : nullptr;
  const uint16_t* xb = pairs && !xf ? static_cast<const uint16_t*>(x) : nullptr;
  const float* xp = pairs ? nullptr : static_cast<const float*>(x);
  const uint16_t* w16 = bf16 ? static_cast<const uint16_t*>(w) : nullptr;
  const float* w32 = bf16 ? nullptr : static_cast<const float*>(w);
  parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    if (amx) return amx_bf16_panels(xb, w16, yp, M, N, K, p0, p1);
    if (pairs) {
      if (path == FloatPath::Avx512Bf16) return avx512bf16::panel_dot(xb, w16, yp, M, N, K, p0, p1);
      const FlushDenormals as_vdpbf16ps;
      if (path == FloatPath::Avx512) return avx512::pair_fma_dot(xf, w16, yp, M, N, K, p0, p1);
      panel_tiles<4, 1>(M, p0, p1, K, 32, 2, [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
        bf16_tile_avx2<decltype(rows)::value, decltype(panels)::value>(xb, w16, yp, m, p, N, K, k0, k1);
      });
      return;
    }
    if (path != FloatPath::Avx2)
      return widened ? avx512::widened::panel_dot(xp, w16, yp, M, N, K, p0, p1)
                     : avx512::fp32::panel_dot(xp, w32, yp, M, N, K, p0, p1);
    const auto tile = [&](auto rows, auto panels, int64_t m, int64_t p, int64_t k0, int64_t k1) {
      if (widened)
        fp32_tile_avx2<decltype(rows)::value, decltype(panels)::value>(xp, w16, yp, m, p, N, K, k0, k1);
      else
        fp32_tile_avx2<decltype(rows)::value, decltype(panels)::value>(xp, w32, yp, m, p, N, K, k0, k1);
    };
    panel_tiles<6, 1>(M, p0, p1, K, widened ? 32 : 64, 2, tile);
  });
  epilogue(yp, M, N, nullptr, bias);
}

bool bf16_rounded_as_float(int64_t K) { return rounded_as_float(K); }

void round_bf16_to(const float* x, int64_t count, void* out, bool as_float) {
  if (as_float)
    round_bf16(x, count, static_cast<float*>(out));
  else
    round_bf16(x, count, static_cast<uint16_t*>(out));
}
