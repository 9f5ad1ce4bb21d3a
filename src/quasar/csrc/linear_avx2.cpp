// Linear kernels for x86 CPUs with AVX2. W8A8: dynamic per-token int8 activations, int8 per-channel
// weights (below); float_act_linear: float32 activations times int8 (W8A16) or bfloat16 weights.
//
//   y[m, n] = (sum_k q(x)[m, k] * w[n, k]) * x_scale[m] * w_scale[n] + bias[n]
//   x_scale[m] = max_k |x[m, k]| / 127 (1 for an all-zero row), q(x) = clamp(round_half_even(x / x_scale))
//
// The quantization matches quasar.quant.int8.quantize_tokens bit for bit, the dot products are exact
// in int32 (_mm256_madd_epi16 on sign-extended int16, no saturation for |values| <= 127), and every row
// is computed the same way whatever the other rows are: verifying k tokens together gives the rows that
// decoding them one by one gives. Weights [N, K] stream from memory once per call; the quantized
// activations (int16, M * K * 2 bytes) stay in cache.
#include "kernels.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>

namespace {

// Weights stream from memory once per call; hardware prefetch alone left the int8 loops at about half the
// read bandwidth, so each loop also asks for the bytes this far ahead.
constexpr int64_t kPrefetch = 1024;

inline int32_t hsum(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// Quantize each row of x [M, K] to int16 values in [-127, 127]; write the row scales.
void quantize_rows(const float* x, int64_t M, int64_t K, int16_t* q, float* scale) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float absmax = 0.f;
    for (int64_t k = 0; k < K; ++k) absmax = std::max(absmax, std::fabs(row[k]));
    const float s = absmax > 0.f ? absmax / 127.f : 1.f;
    scale[m] = s;
    for (int64_t k = 0; k < K; ++k) {
      float v = std::nearbyint(row[k] / s);
      q[m * K + k] = static_cast<int16_t>(std::min(127.f, std::max(-127.f, v)));
    }
  }
}

template <int MB>
void dot_block(const int16_t* q, const int8_t* w, int32_t* acc_out, int64_t m0, int64_t N, int64_t K,
               int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wn = w + n * K;
    __m256i acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + k + kPrefetch), _MM_HINT_T0);
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k)));
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (m0 + i) * K + k));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(wv, xv));
      }
    }
    for (int i = 0; i < MB; ++i) acc_out[(m0 + i) * N + n] = hsum(acc[i]);
  }
}

// Few rows (decode): four output channels per pass share each activation load and one reduction. The
// int32 sums are exact, so any order gives the same result as dot_block.
template <int MB>
void dot_block_n4(const int16_t* q, const int8_t* w, int32_t* acc_out, int64_t m0, int64_t N, int64_t K,
                  int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    __m256i acc[MB][4];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 16) {
      __m256i wv[4];
      _mm_prefetch(reinterpret_cast<const char*>(w + n * K + 4 * k + kPrefetch), _MM_HINT_T0);
      for (int j = 0; j < 4; ++j)
        wv[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (n + j) * K + k)));
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (m0 + i) * K + k));
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(wv[j], xv));
      }
    }
    for (int i = 0; i < MB; ++i) {  // four horizontal sums at once
      const __m256i s01 = _mm256_hadd_epi32(acc[i][0], acc[i][1]), s23 = _mm256_hadd_epi32(acc[i][2], acc[i][3]);
      const __m256i s = _mm256_hadd_epi32(s01, s23);  // per 128-bit half: n, n+1, n+2, n+3
      const __m128i r = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(acc_out + (m0 + i) * N + n), r);
    }
  }
  if (n < n1) dot_block<MB>(q, w, acc_out, m0, N, K, n, n1);
}

// Rows [0, M) in blocks of MAX rows and one last block of the rest: block(rows, m0) is called with rows a
// std::integral_constant, so each block size gets its own unrolled kernel.
template <int R, typename F>
void last_block(int64_t rest, int64_t m0, F& block) {
  if constexpr (R > 0) {
    if (rest == R) block(std::integral_constant<int, R>{}, m0);
    else last_block<R - 1>(rest, m0, block);
  }
}

template <int MAX, typename F>
void row_blocks(int64_t M, F block) {
  int64_t m = 0;
  for (; m + MAX <= M; m += MAX) block(std::integral_constant<int, MAX>{}, m);
  last_block<MAX - 1>(M - m, m, block);
}

// Output channels [n0, n1) of q . w^T. All rows of a block share each widened weight load: up to 8 rows
// per pass over the weights.
void int_dot_range(const int16_t* q, const int8_t* w, int32_t* out, int64_t M, int64_t N, int64_t K, int64_t n0,
                   int64_t n1) {
  if (M <= 2) {
    if (M == 2) dot_block_n4<2>(q, w, out, 0, N, K, n0, n1);
    else dot_block_n4<1>(q, w, out, 0, N, K, n0, n1);
    return;
  }
  row_blocks<8>(M, [&](auto rows, int64_t m) { dot_block<decltype(rows)::value>(q, w, out, m, N, K, n0, n1); });
}

void int_dot(const int16_t* q, const int8_t* w, int32_t* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { int_dot_range(q, w, out, M, N, K, n0, n1); });
}

// Several weights of the same input in one parallel region over all their output channels (one thread
// fork and join instead of one per weight).
void int_dot_many(const int16_t* q, const std::vector<const int8_t*>& w, const std::vector<int32_t*>& out,
                  const std::vector<int64_t>& N, int64_t M, int64_t K) {
  std::vector<int64_t> first(N.size() + 1, 0);
  for (size_t i = 0; i < N.size(); ++i) first[i + 1] = first[i] + N[i];
  at::parallel_for(0, first.back(), 16, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < N.size(); ++i) {
      const int64_t n0 = std::max(a, first[i]) - first[i], n1 = std::min(b, first[i + 1]) - first[i];
      if (n0 < n1) int_dot_range(q, w[i], out[i], M, N[i], K, n0, n1);
    }
  });
}

// ---- float activations x low-precision weights (W8A16 int8, bf16): fp32 FMA in a fixed order ----------

// Eight weights widened to float32.
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const uint16_t* p) {  // bfloat16: the high half of a float32
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

// Sum of the 8 lanes of a + b, always in the same order.
inline float hsum_ps(__m256 a, __m256 b) {
  const __m256 v = _mm256_add_ps(a, b);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Every row runs the same instruction sequence (two accumulators, K in steps of 16), whatever MB is,
// so a row's result never depends on how many rows the call has.
template <int MB, typename W>
void fdot_block(const float* x, const W* w, float* out, int64_t m0, int64_t N, int64_t K, int64_t n0,
                int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W* wn = w + n * K;
    __m256 a0[MB], a1[MB];
    for (int i = 0; i < MB; ++i) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
      _mm_prefetch(reinterpret_cast<const char*>(wn + k) + kPrefetch, _MM_HINT_T0);
      const __m256 w0 = load8(wn + k), w1 = load8(wn + k + 8);
      for (int i = 0; i < MB; ++i) {
        const float* xr = x + (m0 + i) * K + k;
        a0[i] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), a0[i]);
        a1[i] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), a1[i]);
      }
    }
    for (int i = 0; i < MB; ++i) out[(m0 + i) * N + n] = hsum_ps(a0[i], a1[i]);
  }
}

// Up to 6 rows per pass over the weights (12 accumulators + 3 operands fill the 16 registers).
template <typename W>
void float_dot(const float* x, const W* w, float* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    row_blocks<6>(M, [&](auto rows, int64_t m) { fdot_block<decltype(rows)::value>(x, w, out, m, N, K, n0, n1); });
  });
}

// y [M, N] = (y * scale[n]) + bias[n], each step rounded to float32 (scale, bias may be empty).
void epilogue(float* y, int64_t M, int64_t N, const torch::Tensor& scale, const torch::Tensor& bias) {
  const float* sp = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
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

// Float activations times int8 (W8A16) or bfloat16 weights, fp32 accumulation in a fixed order:
// x [M, K] float32, w [N, K] int8 or bfloat16, scale [N] float32 or empty, bias [N] float32 or empty
// -> y [M, N] float32 = (x . w[n]) * scale[n] + bias[n]. Row m of the result depends on x[m] only.
torch::Tensor float_act_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32, "float32 x expected");
  TORCH_CHECK(w.dtype() == torch::kInt8 || w.dtype() == torch::kBFloat16, "int8 or bfloat16 w expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16");
  x = x.contiguous();
  w = w.contiguous();
  scale = scale.contiguous();
  bias = bias.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(scale.numel() == 0 || scale.numel() == N, "scale must have N entries");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "bias must have N entries");
  auto y = torch::empty({M, N}, x.options());
  if (w.dtype() == torch::kInt8)
    float_dot(x.data_ptr<float>(), w.data_ptr<int8_t>(), y.data_ptr<float>(), M, N, K);
  else
    float_dot(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
              y.data_ptr<float>(), M, N, K);
  epilogue(y.data_ptr<float>(), M, N, scale, bias);
  return y;
}

// x [M, K] float32, w [N, K] int8 -> exact int32 [M, N] of the per-token-quantized x times w, and x_scale [M, 1].
std::vector<torch::Tensor> quantized_int_mm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kInt8, "float32 x and int8 w expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt16));
  auto scale = torch::empty({M, 1}, x.options());
  auto out = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), scale.data_ptr<float>());
  int_dot(q.data_ptr<int16_t>(), w.data_ptr<int8_t>(), out.data_ptr<int32_t>(), M, N, K);
  return {out, scale};
}

// x [M, K] int8 (already quantized), w [N, K] int8 -> exact int32 [M, N].
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kInt8 && w.dtype() == torch::kInt8, "int8 inputs expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) % 16 == 0, "K must be a multiple of 16");
  auto q = x.contiguous().to(torch::kInt16);
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = torch::empty({M, N}, x.options().dtype(torch::kInt32));
  int_dot(q.data_ptr<int16_t>(), w.data_ptr<int8_t>(), out.data_ptr<int32_t>(), M, N, K);
  return out;
}

namespace {

// y [M, N] = acc * x_scale[m] * w_scale[n] (+ bias[n]), rounded exactly as the torch reference.
torch::Tensor rescale(const torch::Tensor& acc, const torch::Tensor& x_scale, torch::Tensor w_scale, torch::Tensor bias) {
  const int64_t M = acc.size(0), N = acc.size(1);
  auto y = torch::empty({M, N}, x_scale.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = x_scale.data_ptr<float>();
  w_scale = w_scale.contiguous();
  bias = bias.contiguous();
  const float* ws = w_scale.data_ptr<float>();
  const bool has_bias = bias.numel() > 0;
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float v = static_cast<float>(ap[m * N + n]) * xs[m] * ws[n];
      yp[m * N + n] = has_bias ? v + bp[n] : v;
    }
  return y;
}

}  // namespace

// The whole W8A8 linear: x [M, K] float32, w [N, K] int8, w_scale [N] float32, bias [N] float32 or empty
// -> y [M, N] float32 = acc * x_scale[m] * w_scale[n] (+ bias[n]), rounded exactly as the torch reference.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor bias) {
  auto res = quantized_int_mm(x, w);
  return rescale(res[0], res[1], w_scale, bias);
}

// Several W8A8 linears of the same input (q/k/v, gate/up): x is quantized once; one result per weight,
// each bitwise equal to w8a8_linear(x, w[i], w_scale[i], bias[i]).
std::vector<torch::Tensor> w8a8_linear_many(torch::Tensor x, std::vector<torch::Tensor> w,
                                            std::vector<torch::Tensor> w_scale, std::vector<torch::Tensor> bias) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) % 16 == 0, "float32 x [M, K], K % 16 == 0");
  TORCH_CHECK(w.size() == w_scale.size() && w.size() == bias.size(), "one scale and one bias per weight");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt16));
  auto x_scale = torch::empty({M, 1}, x.options());
  quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), x_scale.data_ptr<float>());
  std::vector<torch::Tensor> acc;
  std::vector<const int8_t*> wp;
  std::vector<int32_t*> ap;
  std::vector<int64_t> N;
  for (size_t i = 0; i < w.size(); ++i) {
    TORCH_CHECK(w[i].dtype() == torch::kInt8 && w[i].dim() == 2 && w[i].size(1) == K, "int8 w [N, K] expected");
    w[i] = w[i].contiguous();
    acc.push_back(torch::empty({M, w[i].size(0)}, x.options().dtype(torch::kInt32)));
    wp.push_back(w[i].data_ptr<int8_t>());
    ap.push_back(acc.back().data_ptr<int32_t>());
    N.push_back(w[i].size(0));
  }
  int_dot_many(q.data_ptr<int16_t>(), wp, ap, N, M, K);
  std::vector<torch::Tensor> out;
  for (size_t i = 0; i < w.size(); ++i) out.push_back(rescale(acc[i], x_scale, w_scale[i], bias[i]));
  return out;
}

// RMSNorm of each row: y = weight * (x * (1 / sqrt(mean(x^2) + eps))), float32, the sum of squares in a
// fixed order (8 lanes, then the lanes), so a row's result depends on that row only.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && weight.dtype() == torch::kFloat32, "float32 x and weight expected");
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1) && x.size(1) % 8 == 0, "x [M, K], weight [K], K % 8 == 0");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
      const __m256 v = _mm256_loadu_ps(row + k);
      acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    const float inv = 1.f / std::sqrt(hsum_ps(acc, _mm256_setzero_ps()) / static_cast<float>(K) + static_cast<float>(eps));
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (int64_t k = 0; k < K; k += 8)
      _mm256_storeu_ps(yp + m * K + k,
                       _mm256_mul_ps(_mm256_loadu_ps(wp + k), _mm256_mul_ps(_mm256_loadu_ps(row + k), inv8)));
  }
  return y;
}
