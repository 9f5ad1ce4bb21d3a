// The float-activation linears on AVX-512 (float_dot.h has the arithmetic and the entry points), each instruction
// set in a target region of its own, so the templates are compiled for that instruction set (see dpbusd_path.h):
// - AVX-512 (float32 lanes): float_act_linear's 16 lanes in one register; bf16_linear's pairs as two FMAs and
//   fp32_linear's chains, on 16 channels a register.
// - AVX512-BF16: bf16_linear by vdpbf16ps, 16 channels an instruction.
#include "float_dot.h"
#include "simd_lanes.h"
#include "targets.h"

#include <immintrin.h>
#include <type_traits>

using namespace float_dot;

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

template <typename W>
void act32_avx512(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  avx512::act32(x, w, y, M, N, K, n0, n1);
}

template void act32_avx512(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void act32_avx512(const float*, const int8_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void act32_avx512(const float*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);

void bf16_panels_avx512(const float* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                        int64_t p1) {
  avx512::pair_fma_dot(x, wp, y, M, N, K, p0, p1);
}

void bf16_panels_avx512bf16(const uint16_t* x, const uint16_t* wp, float* y, int64_t M, int64_t N, int64_t K,
                            int64_t p0, int64_t p1) {
  avx512bf16::panel_dot(x, wp, y, M, N, K, p0, p1);
}

template <typename W>
void fp32_panels_avx512(const float* x, const W* wp, float* y, int64_t M, int64_t N, int64_t K, int64_t p0,
                        int64_t p1) {
  if constexpr (std::is_same_v<W, float>)
    avx512::fp32::panel_dot(x, wp, y, M, N, K, p0, p1);
  else
    avx512::widened::panel_dot(x, wp, y, M, N, K, p0, p1);
}

template void fp32_panels_avx512(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void fp32_panels_avx512(const float*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
