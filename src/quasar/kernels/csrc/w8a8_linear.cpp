// The W8A8 linears' front end: dynamic per-token int8 activations (quantized by norm_quant.cpp), int8 per-channel
// or group-wise weights, plain or packed in panels, summed by the int8 kernels of the int8 path this CPU runs
// (int8_dot.cpp, int8_group.cpp, int8_panel.cpp), then rescaled (float-activation linears are in float_dot.cpp).
//
//   y[m, n] = (sum_k q(x)[m, k] * w[n, k]) * x_scale[m] * w_scale[n] + bias[n]
//   x_scale[m] = max_k |x[m, k]| / 127 (1 for an all-zero row), q(x) = clamp(round_half_even(x / x_scale))
//
// The quantization matches quasar.quant.int8.quantize_tokens bit for bit, the dot products are exact in
// int32 (int8_dot.cpp, on the fastest instruction set this CPU has), and every row is computed the same
// way whatever the other rows are: verifying k tokens together gives the rows that decoding them one by
// one gives. Weights [N, K] stream from memory once per call; the quantized activations (int8, M * K
// bytes) stay in cache.
#include "kernels.h"
#include "blocking.h"
#include "int8_dot.h"
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

namespace {

// How a group-wise weight is laid out (int8_panel.cpp): plain [N, K] int8, or packed in panels of 16 channels
// x 4 inputs, [N/16][K/4][16][4] with w_scale [N/16][K/G][16], as unsigned bytes w + 128 (the dpbusd path, AVX-512
// VNNI) or as signed bytes w (maddubs, AVX2).
enum class Panels { None, Unsigned, Signed };

// One int8 weight of a call: its int32 sums and, for a whole linear, the rescaled float32 output.
// Per channel (G = 0): acc [M, N], y = acc * x_scale[m] * w_scale[n] (+ bias[n]); y nullptr: int32 only.
// Per group of G inputs: no acc; y = sum_g x_scale[m, g] * w_scale[n, g] * dot_g (+ bias[n]).
struct IntJob {
  const int8_t* w;
  int64_t N;
  int32_t* acc;          // [M, N]
  float* y = nullptr;    // [M, N]
  const float* w_scale = nullptr;
  const float* bias = nullptr;
  int64_t G = 0;
  Panels panels = Panels::None;
};

// y[m, n] += bias[n] for channels [n0, n1).
void add_bias(const IntJob& job, int64_t M, int64_t n0, int64_t n1) {
  if (!job.bias) return;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) job.y[m * job.N + n] += job.bias[n];
}

// y = acc * x_scale[m] * w_scale[n] (+ bias[n]) for channels [n0, n1), rounded as the torch reference.
void rescale_range(const IntJob& job, const float* x_scale, int64_t M, int64_t n0, int64_t n1) {
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

// All jobs of one quantized input q [M, K] in one parallel region over all their output channels (one
// thread fork and join instead of one per weight); each thread rescales the channels it summed.
void run_jobs(Int8Path path, const int8_t* q, const float* x_scale, const std::vector<IntJob>& jobs, int64_t M,
              int64_t K) {
  bool any_unsigned = false, any_plain = false;
  for (const IntJob& job : jobs) {
    TORCH_CHECK(job.panels != Panels::Unsigned || path == Int8Path::Dpbusd,
                "int8 weights packed as w + 128 need the dpbusd path (AVX-512 VNNI)");
    any_unsigned = any_unsigned || job.panels == Panels::Unsigned;
    any_plain = any_plain || job.panels == Panels::None;
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
  at::parallel_for(0, first.back(), 16, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < jobs.size(); ++i) {
      const int64_t n0 = std::max(a, first[i]) - first[i], n1 = std::min(b, first[i + 1]) - first[i];
      if (n0 >= n1) continue;
      const IntJob& job = jobs[i];
      if (job.panels != Panels::None) {  // whole 16-channel panels: those that start in [n0, n1)
        packed_panel_range(job.w, job.panels == Panels::Unsigned, job.w_scale, job.bias, q, start.data(), x_scale,
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

}  // namespace

namespace {

void check_int8_weight(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kChar && w.dim() == 2 && w.size(1) == K, "int8 w [N, K] expected");
}

// x [M, K] float32 -> (int8 q [M, K], float32 x_scale [M, K / G]), as quantize_tokens (G = K: per row).
std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t G) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) % 16 == 0, "float32 x [M, K], K % 16 == 0");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(G % 16 == 0 && K % G == 0, "group size ", G, " must be a multiple of 16 dividing K = ", K);
  auto q = kernel_result({M, K}, x.options().dtype(at::kChar));
  auto scale = kernel_result({M, K / G}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = scale.data_ptr<float>();
  over_rows(M, K, [&](int64_t m0, int64_t m1) {
    quantize_rows(xp + m0 * K, m1 - m0, K, G, qp + m0 * K, sp + m0 * (K / G));
  });
  return {q, scale};
}

// The group size of a W8A8 weight's scales: 0 for w_scale [N] (per channel), K / groups for [N, groups].
int64_t group_size(const at::Tensor& w_scale, int64_t N, int64_t K) {
  TORCH_CHECK(w_scale.dtype() == at::kFloat && w_scale.size(0) == N && w_scale.dim() <= 2,
              "float32 w_scale [N] or [N, K / G] expected");
  if (w_scale.dim() == 1) return 0;
  const int64_t groups = w_scale.size(1), G = groups ? K / groups : 0;
  TORCH_CHECK(groups > 0 && G * groups == K && G % 32 == 0, "w_scale [N, K / G] needs a group size G that is a "
              "multiple of 32 dividing K = ", K, ", got ", groups, " groups");
  return G;
}

}  // namespace

// x [M, K] int8 (already quantized), w [N, K] int8 -> exact int32 [M, N], on `path` (see int8_dot.cpp).
// maddubs takes |x| <= 127, so there x = max(x, -127) + d with d in {-1, 0}, and rows holding -128 get a
// second pass over d; the dpbusd paths take every int8 value.
at::Tensor int8_mm(at::Tensor x, at::Tensor w, const std::string& path) {
  TORCH_CHECK(x.dtype() == at::kChar && x.dim() == 2 && x.size(1) % 16 == 0, "int8 x [M, K], K % 16 == 0");
  w = w.contiguous();
  check_int8_weight(w, x.size(1));
  const Int8Path p = parse_int8_path(path);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto input = p == Int8Path::Maddubs ? x.clamp_min(-127).contiguous() : x.contiguous();
  auto out = kernel_result({M, N}, x.options().dtype(at::kInt));
  run_jobs(p, input.data_ptr<int8_t>(), nullptr, {IntJob{w.data_ptr<int8_t>(), N, out.data_ptr<int32_t>()}}, M, K);
  if (p != Int8Path::Maddubs) return out;
  auto low = x.eq(-128);
  if (low.any().item<bool>()) out += int8_mm(low.to(at::kChar).neg(), w, path);  // d: -1 where x was -128
  return out;
}

// Group-wise int8 product without the quantization, for tests: q [M, K] int8 (|q| <= 127 on "maddubs"),
// x_scale [M, K / G], w [N, K] int8, w_scale [N, K / G] float32 -> float32 [M, N] on `path`.
at::Tensor int8_group_mm(at::Tensor q, at::Tensor x_scale, at::Tensor w, at::Tensor w_scale,
                            const std::string& path) {
  TORCH_CHECK(q.dtype() == at::kChar && q.dim() == 2, "int8 q [M, K] expected");
  q = q.contiguous();
  w = w.contiguous();
  w_scale = w_scale.contiguous();
  x_scale = x_scale.contiguous();
  const int64_t M = q.size(0), K = q.size(1), N = w.size(0);
  check_int8_weight(w, K);
  TORCH_CHECK(w_scale.dim() == 2, "w_scale [N, K / G] expected");
  const int64_t G = group_size(w_scale, N, K);
  TORCH_CHECK(x_scale.dtype() == at::kFloat && x_scale.dim() == 2 && x_scale.size(0) == M &&
              x_scale.size(1) == K / G, "float32 x_scale [M, K / G] expected");
  const Int8Path p = parse_int8_path(path);
  TORCH_CHECK(p != Int8Path::Maddubs || q.min().item<int>() > -128, "the maddubs path takes q in [-127, 127]");
  auto y = kernel_result({M, N}, x_scale.options());
  run_jobs(p, q.data_ptr<int8_t>(), x_scale.data_ptr<float>(),
           {IntJob{w.data_ptr<int8_t>(), N, nullptr, y.data_ptr<float>(), w_scale.data_ptr<float>(), nullptr, G}}, M, K);
  return y;
}

// Several W8A8 linears of the same input (q/k/v, gate/up): x is quantized once, one parallel region sums
// and rescales all of them. Each result is bitwise the torch reference of its linear:
// y [M, N] = acc * x_scale[m] * w_scale[n] (+ bias[n]).
std::vector<at::Tensor> w8a8_linear_many(at::Tensor x, std::vector<at::Tensor> w,
                                            std::vector<at::Tensor> w_scale, std::vector<at::Tensor> bias) {
  TORCH_CHECK(w.size() == w_scale.size() && w.size() == bias.size() && !w.empty(), "one scale and one bias per weight");
  TORCH_CHECK(x.dim() == 2, "x [M, K] expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<IntJob> jobs;
  std::vector<at::Tensor> acc, out;
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = w[i].contiguous();
    const bool packed = w[i].dim() == 4;  // [N/16][K/4][16][4] uint8 w + 128 or int8 w, w_scale [N/16][K/G][16]
    const bool bytes = w[i].dtype() == at::kByte || w[i].dtype() == at::kChar;
    TORCH_CHECK(!packed || (bytes && w[i].size(1) * 4 == K && w[i].size(2) == 16 && w[i].size(3) == 4 &&
                            w_scale[i].dim() == 3 && w_scale[i].size(2) == 16),
                "packed uint8 w + 128 or int8 w [N/16, K/4, 16, 4] with w_scale [N/16, K/G, 16] expected");
    if (!packed) check_int8_weight(w[i], K);
    const int64_t N = packed ? w[i].size(0) * 16 : w[i].size(0);
    w_scale[i] = w_scale[i].contiguous();
    bias[i] = bias[i].contiguous();
    const int64_t G = packed ? K / w_scale[i].size(1) : group_size(w_scale[i], N, K);
    TORCH_CHECK(!packed || (w_scale[i].dtype() == at::kFloat && G * w_scale[i].size(1) == K && G % 32 == 0),
                "packed w_scale [N/16, K/G, 16] needs a group size G that is a multiple of 32 dividing K");
    TORCH_CHECK(jobs.empty() || jobs[0].G == G, "the linears of one input must share their group size");
    TORCH_CHECK(bias[i].numel() == 0 || (bias[i].dtype() == at::kFloat && bias[i].numel() == N),
                "float32 bias [N] or empty expected");
    acc.push_back(G ? at::Tensor() : kernel_result({M, N}, x.options().dtype(at::kInt)));
    out.push_back(kernel_result({M, N}, x.options()));
    jobs.push_back(IntJob{static_cast<const int8_t*>(w[i].data_ptr()), N, G ? nullptr : acc.back().data_ptr<int32_t>(),
                          out.back().data_ptr<float>(), w_scale[i].data_ptr<float>(),
                          bias[i].numel() ? bias[i].data_ptr<float>() : nullptr, G,
                          !packed ? Panels::None : w[i].dtype() == at::kByte ? Panels::Unsigned : Panels::Signed});
  }
  auto [q, x_scale] = quantize(x, jobs[0].G ? jobs[0].G : K);
  run_jobs(linear_path(), q.data_ptr<int8_t>(), x_scale.data_ptr<float>(), jobs, M, K);
  return out;
}

// The whole W8A8 linear: x [M, K] float32, w [N, K] int8, w_scale [N] float32, bias [N] float32 or empty.
at::Tensor w8a8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor bias) {
  return w8a8_linear_many(x, {w}, {w_scale}, {bias})[0];
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
