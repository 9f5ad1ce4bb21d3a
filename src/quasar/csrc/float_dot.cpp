// Float-activation linears: y [M, N] = x [M, K] . w [N, K]^T (* scale[n]) (+ bias[n]), float32 sums in one
// fixed order per output, whatever the instruction set and however many rows come together. Two products:
//
// - float_act_linear: float32 x times float32 (the fp32 verifier), bfloat16 (the bf16 lm_head of W8A8
//   checkpoints) or int8 (W8A16, with a per-channel scale) weights, widened to float32 in registers. An
//   output is 16 lanes, lane j summing the k = j (mod 16) in k order with FMAs, then hsum_ps(lanes 0-7,
//   lanes 8-15). AVX2 keeps the 16 lanes in two registers, AVX-512 in one: the same float either way.
// - bf16_linear: x rounded to bfloat16 (to nearest even, as torch's x.to(torch.bfloat16)) times bfloat16
//   weights, float32 sums: the bf16 verifier (as llama.cpp runs a BF16 model). An output is 16 lanes, lane
//   j taking the pairs (32 s + 2 j, 32 s + 2 j + 1), the odd element first: exactly AVX512-BF16's vdpbf16ps,
//   which runs it where the CPU has it. AVX2 runs the same two FMAs per pair; a product of two bfloat16 is
//   exact in float32, so each FMA rounds once, as vdpbf16ps does. (vdpbf16ps also flushes denormal inputs
//   and results to zero, the AVX2 path does not: results differ only where a product or partial sum falls
//   below 1.2e-38.)
//
// Both are tiled: R rows x C channels of accumulators in registers, so each weight load serves R rows and
// each activation load C channels, and a thread walks its channels in blocks small enough to stay in L2
// while every row passes: a prefill of many rows reads each weight from memory once.
#include "kernels.h"
#include "blocking.h"
#include "float_lanes.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <atomic>

namespace {

enum class FloatPath { Avx2, Avx512, Avx512Bf16 };

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
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = hsum_ps(acc[0][r][c], acc[1][r][c]);
}

// Bfloat16 x and w, vdpbf16ps in two FMAs per pair: a 32-bit lane holding elements (2 j, 2 j + 1) gives
// the odd one as its high half (mask) and the even one shifted up. R <= 2, C <= 2.
template <int R, int C>
void bf16_tile_avx2(const uint16_t* x, const uint16_t* w, float* y, int64_t m0, int64_t n0, int64_t N, int64_t K) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 acc[2][R][C];
#pragma GCC unroll 16
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[h][r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) prefetch_row(w + (n0 + c) * K + k);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      __m256 w_odd[C], w_even[C];
#pragma GCC unroll 4
      for (int c = 0; c < C; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + c) * K + k + 16 * h));
        w_odd[c] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        w_even[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + (m0 + r) * K + k + 16 * h));
        const __m256 x_odd = _mm256_castsi256_ps(_mm256_and_si256(v, high));
        const __m256 x_even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
#pragma GCC unroll 4
        for (int c = 0; c < C; ++c) {
          acc[h][r][c] = _mm256_fmadd_ps(x_odd, w_odd[c], acc[h][r][c]);
          acc[h][r][c] = _mm256_fmadd_ps(x_even, w_even[c], acc[h][r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = hsum_ps(acc[0][r][c], acc[1][r][c]);
}

// x [count] float32 -> bfloat16 bits, to nearest even (NaN stays a quiet NaN): torch's rounding, 8 at a time.
void round_bf16(const float* x, int64_t count, uint16_t* out) {
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), nan = _mm256_set1_epi32(0x7FC0);
  for (int64_t i = 0; i < count; i += 8) {
    const __m256 f = _mm256_loadu_ps(x + i);
    const __m256i v = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(v, 16), one);
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(v, _mm256_add_epi32(half, lsb)), 16);
    r = _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // 8 uint16 in the low half
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_castsi256_si128(packed));
  }
}

}  // namespace

// ---- AVX-512 (float32 lanes) and AVX512-BF16 (vdpbf16ps) ---------------------------------------------
// Each in a target region, so the templates are compiled for that instruction set (see dpbusd_path.h).

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
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

// The 16 lanes as hsum_ps sums the AVX2 path's two registers.
inline float sum16(__m512 a) {
  return hsum_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
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
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = sum16(acc[r][c]);
}

template <typename W>
void act32(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  tiles<4, 4>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), [&](auto rows, auto cols, int64_t m, int64_t n) {
    act32_tile<decltype(rows)::value, decltype(cols)::value>(x, w, y, m, n, N, K);
  });
}

}  // namespace
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
namespace avx512bf16 {
namespace {

inline float sum16(__m512 a) {
  return hsum_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

inline __m512bh load_bf16(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

// R <= 4, C <= 4, one vdpbf16ps per row, channel and 32 inputs.
template <int R, int C>
void bf16_tile(const uint16_t* x, const uint16_t* w, float* y, int64_t m0, int64_t n0, int64_t N, int64_t K) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) xv[r] = load_bf16(x + (m0 + r) * K + k);
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      prefetch_row(w + (n0 + c) * K + k);
      const __m512bh wv = load_bf16(w + (n0 + c) * K + k);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv[r], wv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m0 + r) * N + n0 + c] = sum16(acc[r][c]);
}

void bf16_dot(const uint16_t* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1) {
  tiles<4, 4>(M, n0, n1, K * 2, [&](auto rows, auto cols, int64_t m, int64_t n) {
    bf16_tile<decltype(rows)::value, decltype(cols)::value>(x, w, y, m, n, N, K);
  });
}

}  // namespace
}  // namespace avx512bf16
#pragma GCC pop_options

namespace {

std::vector<FloatPath> available_paths() {
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  std::vector<FloatPath> paths;
  if (avx512 && __builtin_cpu_supports("avx512bf16")) paths.push_back(FloatPath::Avx512Bf16);
  if (avx512) paths.push_back(FloatPath::Avx512);
  paths.push_back(FloatPath::Avx2);
  return paths;
}

const char* path_name(FloatPath p) {
  return p == FloatPath::Avx512Bf16 ? "avx512bf16" : p == FloatPath::Avx512 ? "avx512" : "avx2";
}

std::atomic<int>& path_slot() {
  static std::atomic<int> slot{static_cast<int>(available_paths().front())};
  return slot;
}

FloatPath current_path() { return static_cast<FloatPath>(path_slot().load(std::memory_order_relaxed)); }

template <typename W>
void act32_dot(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  const FloatPath path = current_path();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (path != FloatPath::Avx2) return avx512::act32(x, w, y, M, N, K, n0, n1);
    tiles<3, 2>(M, n0, n1, K * static_cast<int64_t>(sizeof(W)), [&](auto rows, auto cols, int64_t m, int64_t n) {
      act32_tile_avx2<decltype(rows)::value, decltype(cols)::value>(x, w, y, m, n, N, K);
    });
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

void check_float_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias, int64_t multiple) {
  TORCH_CHECK(x.dtype() == torch::kFloat32, "float32 x expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) % multiple == 0, "K must be a multiple of ", multiple);
  TORCH_CHECK(bias.numel() == 0 || (bias.dtype() == torch::kFloat32 && bias.numel() == w.size(0)),
              "float32 bias [N] or empty expected");
}

}  // namespace

std::vector<std::string> float_paths() {
  std::vector<std::string> names;
  for (FloatPath p : available_paths()) names.push_back(path_name(p));
  return names;
}

std::string float_path() { return path_name(current_path()); }

std::string use_float_path(const std::string& name) {
  for (FloatPath p : available_paths())
    if (name == "auto" || name == path_name(p)) {
      path_slot().store(static_cast<int>(p));
      return path_name(p);
    }
  TORCH_CHECK(false, "float path '", name, "' is not available on this CPU; available: auto, ", c10::Join(", ", float_paths()));
}

// Float activations times float32, int8 (W8A16) or bfloat16 weights, float32 sums in a fixed order:
// x [M, K] float32, w [N, K], scale [N] float32 or empty, bias [N] float32 or empty
// -> y [M, N] float32 = (x . w[n]) * scale[n] + bias[n]. Row m of the result depends on x[m] only.
torch::Tensor float_act_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias) {
  TORCH_CHECK(w.dtype() == torch::kInt8 || w.dtype() == torch::kBFloat16 || w.dtype() == torch::kFloat32,
              "float32, int8 or bfloat16 w expected");
  check_float_linear(x, w, bias, 16);
  x = x.contiguous();
  w = w.contiguous();
  scale = scale.contiguous();
  bias = bias.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(scale.numel() == 0 || (scale.dtype() == torch::kFloat32 && scale.numel() == N),
              "float32 scale [N] or empty expected");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (w.dtype() == torch::kInt8)
    act32_dot(xp, w.data_ptr<int8_t>(), yp, M, N, K);
  else if (w.dtype() == torch::kFloat32)
    act32_dot(xp, w.data_ptr<float>(), yp, M, N, K);
  else
    act32_dot(xp, reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), yp, M, N, K);
  epilogue(yp, M, N, scale.numel() ? scale.data_ptr<float>() : nullptr, bias.numel() ? bias.data_ptr<float>() : nullptr);
  return y;
}

// x [M, K] float32 rounded to bfloat16, times w [N, K] bfloat16, float32 sums as vdpbf16ps takes them, plus
// bias [N] float32 (or empty) -> y [M, N] float32. Row m of the result depends on x[m] only.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(w.dtype() == torch::kBFloat16, "bfloat16 w expected");
  check_float_linear(x, w, bias, 32);
  x = x.contiguous();
  w = w.contiguous();
  bias = bias.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  std::vector<uint16_t> xb(M * K);
  round_bf16(x.data_ptr<float>(), M * K, xb.data());
  auto y = torch::empty({M, N}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const FloatPath path = current_path();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (path == FloatPath::Avx512Bf16) return avx512bf16::bf16_dot(xb.data(), wp, yp, M, N, K, n0, n1);
    tiles<2, 2>(M, n0, n1, K * 2, [&](auto rows, auto cols, int64_t m, int64_t n) {
      bf16_tile_avx2<decltype(rows)::value, decltype(cols)::value>(xb.data(), wp, yp, m, n, N, K);
    });
  });
  epilogue(yp, M, N, nullptr, bias.numel() ? bias.data_ptr<float>() : nullptr);
  return y;
}
