// The W8A8 linears' front end: dynamic per-token int8 activations (quantized by norm_quant.cpp), int8 per-channel
// or group-wise weights, plain or packed in panels, summed by the int8 kernels of the int8 path this CPU runs
// (int8_dot.cpp, int8_group.cpp, int8_panel_avx2.cpp and int8_panel_avx512.cpp), then rescaled (float-activation linears are in float_dot.cpp).
//
//   y[m, n] = (sum_k q(x)[m, k] * w[n, k]) * x_scale[m] * w_scale[n] + bias[n]
//   x_scale[m] = max_k |x[m, k]| / 127 (1 for an all-zero row), q(x) = clamp(round_half_even(x / x_scale))
//
// The quantization matches quasar.quant.int8.quantize_tokens bit for bit, the dot products are exact in
// int32 (int8_dot.cpp, on the fastest instruction set this CPU has), and every row is computed the same
// way whatever the other rows are: verifying k tokens together gives the rows that decoding them one by
// one gives. Weights [N, K] stream from memory once per call; the quantized activations (int8, M * K
// bytes) stay in cache.
#include "kernel_ops.h"
#include "blocking.h"
#include "int8_dot.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>

namespace {

// y[m, n] += bias[n] for channels [n0, n1).
void add_bias(const Int8Job& job, int64_t M, int64_t n0, int64_t n1) {
  if (!job.bias) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) job.y[m * job.N + n] += job.bias[n];
}

// y = acc * x_scale[m] * w_scale[n] (+ bias[n]) for channels [n0, n1), rounded as the torch reference.
void rescale_range(const Int8Job& job, const float* x_scale, int64_t M, int64_t n0, int64_t n1) {
  const int64_t N = job.N;
  for (int64_t m = 0; m < M; ++m) {
    const __m256 xs = _mm256_set1_ps(x_scale[m]);
    int64_t n = n0;
    for (; n + 8 <= n1; n += 8) {
      const __m256 a = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.acc + m * N + n)));
      __m256 v = _mm256_mul_ps(_mm256_mul_ps(a, xs), _mm256_loadu_ps(job.w_scale + n));
      if (job.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(job.bias + n));
      _mm256_storeu_ps(job.y + m * N + n, v);
    }
    for (; n < n1; ++n) {
      const float v = static_cast<float>(job.acc[m * N + n]) * x_scale[m] * job.w_scale[n];
      job.y[m * N + n] = job.bias ? v + job.bias[n] : v;
    }
  }
}

}  // namespace

void run_int8_jobs(Int8Path path, const int8_t* q, const float* x_scale, const std::vector<Int8Job>& jobs, int64_t M,
                   int64_t K) {
  bool any_unsigned = false, any_plain = false;
  for (const Int8Job& job : jobs) {
    KERNEL_CHECK(job.panels != Int8Panels::Unsigned || path == Int8Path::Dpbusd,
                "int8 weights packed as w + 128 need the dpbusd path (AVX-512 VNNI)");
    any_unsigned = any_unsigned || job.panels == Int8Panels::Unsigned;
    any_plain = any_plain || job.panels == Int8Panels::None;
  }
  std::vector<uint8_t> u;
  if (any_plain) prepare_rows(path, q, M * K, u);
  std::vector<int32_t> start(any_unsigned ? M * K / jobs[0].G : 0);  // packed jobs share one group size
  if (any_unsigned)
    over_rows(M, K, [&](int64_t m0, int64_t m1) {
      group_starts(q + m0 * K, m1 - m0, K, jobs[0].G, start.data() + m0 * (K / jobs[0].G));
    });
  std::vector<int64_t> first(jobs.size() + 1, 0);
  for (size_t i = 0; i < jobs.size(); ++i) first[i + 1] = first[i] + jobs[i].N;
  parallel_for(0, first.back(), 16, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      const int64_t n0 = std::max(a, first[i]) - first[i], n1 = std::min(b, first[i + 1]) - first[i];
      if (n0 >= n1) continue;
      const Int8Job& job = jobs[i];
      if (job.panels != Int8Panels::None) {  // whole 16-channel panels: those that start in [n0, n1)
        packed_panel_range(job.w, job.panels == Int8Panels::Unsigned, job.w_scale, job.bias, q, start.data(), x_scale,
                           job.y, M, job.N, K, job.G, n0, n1);
        continue;
      }
      if (job.G) {
        int8_group_dot(path, q, u.data(), x_scale, job.w, job.w_scale, job.y, M, job.N, K, job.G, n0, n1);
        add_bias(job, M, n0, n1);
        continue;
      }
      int8_dot(path, q, u.data(), job.w, job.acc, M, job.N, K, n0, n1);
      if (job.y) rescale_range(job, x_scale, M, n0, n1);
    }
  });
}

void packed_panel_range(const void* wp, bool unsigned_bytes, const float* wsp, const float* bias, const int8_t* q,
                        const int32_t* start, const float* x_scale, float* out, int64_t M, int64_t N, int64_t K,
                        int64_t G, int64_t n0, int64_t n1) {
  if (unsigned_bytes)
    int8_panel_dot(q, start, x_scale, static_cast<const uint8_t*>(wp), wsp, out, M, N, K, G, n0, n1);
  else
    int8_panel_dot_maddubs(q, x_scale, static_cast<const int8_t*>(wp), wsp, out, M, N, K, G, n0, n1);
  if (!bias) return;
  const int64_t c1 = std::min((n1 + 15) / 16 * 16, N);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = (n0 + 15) / 16 * 16; n < c1; ++n) out[m * N + n] += bias[n];
}
