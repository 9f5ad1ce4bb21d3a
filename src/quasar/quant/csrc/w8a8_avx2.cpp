// W8A8 linear for x86 CPUs with AVX2: dynamic per-token int8 activations, int8 per-channel weights.
//
//   y[m, n] = (sum_k q(x)[m, k] * w[n, k]) * x_scale[m] * w_scale[n] + bias[n]
//   x_scale[m] = max_k |x[m, k]| / 127 (1 for an all-zero row), q(x) = clamp(round_half_even(x / x_scale))
//
// The quantization matches quasar.quant.int8.quantize_tokens bit for bit, the dot products are exact
// in int32 (_mm256_madd_epi16 on sign-extended int16, no saturation for |values| <= 127), and every row
// is computed the same way whatever the other rows are: verifying k tokens together gives the rows that
// decoding them one by one gives. Weights [N, K] stream from memory once per call; the quantized
// activations (int16, M * K * 2 bytes) stay in cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>

namespace {

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
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wn + k)));
      for (int i = 0; i < MB; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (m0 + i) * K + k));
        acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(wv, xv));
      }
    }
    for (int i = 0; i < MB; ++i) acc_out[(m0 + i) * N + n] = hsum(acc[i]);
  }
}

void int_dot(const int16_t* q, const int8_t* w, int32_t* out, int64_t M, int64_t N, int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) dot_block<4>(q, w, out, m, N, K, n0, n1);
    for (; m + 2 <= M; m += 2) dot_block<2>(q, w, out, m, N, K, n0, n1);
    for (; m < M; ++m) dot_block<1>(q, w, out, m, N, K, n0, n1);
  });
}

}  // namespace

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

// The whole W8A8 linear: x [M, K] float32, w [N, K] int8, w_scale [N] float32, bias [N] float32 or empty
// -> y [M, N] float32 = acc * x_scale[m] * w_scale[n] (+ bias[n]), rounded exactly as the torch reference.
torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor bias) {
  auto res = quantized_int_mm(x, w);
  auto acc = res[0];
  const int64_t M = acc.size(0), N = acc.size(1);
  auto y = torch::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* xs = res[1].data_ptr<float>();
  const float* ws = w_scale.contiguous().data_ptr<float>();
  const bool has_bias = bias.numel() > 0;
  const float* bp = has_bias ? bias.contiguous().data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      float v = static_cast<float>(ap[m * N + n]) * xs[m] * ws[n];
      yp[m * N + n] = has_bias ? v + bp[n] : v;
    }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a8_linear", &w8a8_linear, "per-token int8 quantization, exact int32 GEMM, rescale and bias");
  m.def("quantized_int_mm", &quantized_int_mm, "per-token int8 quantization of x, then exact int32 x . w^T");
  m.def("int8_mm", &int8_mm, "exact int8 x int8 -> int32 with w [N, K]");
}
