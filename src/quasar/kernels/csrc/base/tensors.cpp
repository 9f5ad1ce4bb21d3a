// The kernels' operations on tensors (kernels.h), for bindings.cpp and the layer files: each checks its tensors'
// dtypes and shapes, makes them contiguous, makes its results and calls the kernel (kernel_ops.h) on their pointers and
// sizes. The one kernel-side file besides the layer files that includes ATen.
#include "kernels.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

// ---- threads and results -------------------------------------------------------------------------------------------

int64_t kernel_threads() { return at::get_num_threads(); }

at::Tensor kernel_result(at::IntArrayRef sizes, const at::TensorOptions& options) {
  int64_t count = 1;
  for (int64_t s : sizes) count *= s;
  const size_t bytes = pooled_size(static_cast<size_t>(count) * options.dtype().itemsize());
  if (!bytes || options.device().type() != c10::DeviceType::CPU) return at::empty(sizes, options);
  return at::from_blob(take_block(bytes), sizes, [bytes](void* p) { give_back(p, bytes); }, options);
}

namespace {

const float* data_or_null(const at::Tensor& t) { return t.numel() ? t.data_ptr<float>() : nullptr; }

}  // namespace

// ---- W8A8 linears: y[m, n] = (sum_k q(x)[m, k] * w[n, k]) * x_scale[m] * w_scale[n] + bias[n] ----------------------
// (w8a8_linear.cpp; x_scale[m] = max_k |x[m, k]| / 127, 1 for an all-zero row, q(x) = clamp(round_half_even(x /
// x_scale)), as quasar.quant.int8.quantize_tokens: the same bytes.)

namespace {

void check_int8_weight(const at::Tensor& w, int64_t K) {
  TORCH_CHECK(w.dtype() == at::kChar && w.dim() == 2 && w.size(1) == K, "int8 w [N, K] expected");
}

// What quantize_rows takes: float32 x [M, K], K a multiple of 16, groups of G inputs (a multiple of 16 dividing K).
void check_quantizable(const at::Tensor& x, int64_t G) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) % 16 == 0, "float32 x [M, K], K % 16 == 0");
  const int64_t K = x.size(1);
  TORCH_CHECK(G % 16 == 0 && K % G == 0, "group size ", G, " must be a multiple of 16 dividing K = ", K);
}

// x [M, K] float32 -> (int8 q [M, K], float32 x_scale [M, K / G]), as quantize_tokens (G = K: per row).
std::pair<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t G) {
  check_quantizable(x, G);
  const int64_t M = x.size(0), K = x.size(1);
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

// x [M, K] int8 (already quantized), w [N, K] int8 -> exact int32 [M, N], on `path` (see int8_dot.h).
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
  run_int8_jobs(p, input.data_ptr<int8_t>(), nullptr, {Int8Job{w.data_ptr<int8_t>(), N, out.data_ptr<int32_t>()}}, M,
                K);
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
  run_int8_jobs(p, q.data_ptr<int8_t>(), x_scale.data_ptr<float>(),
                {Int8Job{w.data_ptr<int8_t>(), N, nullptr, y.data_ptr<float>(), w_scale.data_ptr<float>(), nullptr, G}},
                M, K);
  return y;
}

namespace {

// The int8 jobs of W8A8 weights (plain [N, K] or packed [N/16, K/4, 16, 4]) over an input of M rows and K inputs, with
// their results: out[i] [M, N] float32 (acc[i]: the int32 sums of a per-channel weight).
struct Int8Jobs {
  std::vector<Int8Job> jobs;
  std::vector<at::Tensor> acc, out;
  int64_t G = 0;  // the group size all the weights share (0: per channel)
};

Int8Jobs int8_jobs(int64_t M, int64_t K, std::vector<at::Tensor>& w, std::vector<at::Tensor>& w_scale,
                   std::vector<at::Tensor>& bias, const at::TensorOptions& options) {
  TORCH_CHECK(w.size() == w_scale.size() && w.size() == bias.size() && !w.empty(), "one scale and one bias per weight");
  Int8Jobs made;
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
    TORCH_CHECK(made.jobs.empty() || made.G == G, "the linears of one input must share their group size");
    TORCH_CHECK(bias[i].numel() == 0 || (bias[i].dtype() == at::kFloat && bias[i].numel() == N),
                "float32 bias [N] or empty expected");
    made.G = G;
    made.acc.push_back(G ? at::Tensor() : kernel_result({M, N}, options.dtype(at::kInt)));
    made.out.push_back(kernel_result({M, N}, options));
    made.jobs.push_back(Int8Job{static_cast<const int8_t*>(w[i].data_ptr()), N,
                                G ? nullptr : made.acc.back().data_ptr<int32_t>(), made.out.back().data_ptr<float>(),
                                w_scale[i].data_ptr<float>(), data_or_null(bias[i]), G,
                                !packed ? Int8Panels::None
                                        : w[i].dtype() == at::kByte ? Int8Panels::Unsigned : Int8Panels::Signed});
  }
  return made;
}

}  // namespace

// Several W8A8 linears of the same input (q/k/v, gate/up): x is quantized once, one parallel region sums
// and rescales all of them. Each result is bitwise the torch reference of its linear:
// y [M, N] = acc * x_scale[m] * w_scale[n] (+ bias[n]).
std::vector<at::Tensor> w8a8_linear_many(at::Tensor x, std::vector<at::Tensor> w,
                                            std::vector<at::Tensor> w_scale, std::vector<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2, "x [M, K] expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  Int8Jobs made = int8_jobs(M, K, w, w_scale, bias, x.options());
  auto [q, x_scale] = quantize(x, made.G ? made.G : K);
  run_int8_jobs(linear_path(), q.data_ptr<int8_t>(), x_scale.data_ptr<float>(), made.jobs, M, K);
  return made.out;
}

// The whole W8A8 linear: x [M, K] float32, w [N, K] int8, w_scale [N] float32, bias [N] float32 or empty.
at::Tensor w8a8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor bias) {
  return w8a8_linear_many(x, {w}, {w_scale}, {bias})[0];
}

// A W8A8 linear whose activations take two int8 passes: x = x_scale1 * q1 + r, and the rounding residual r quantized
// again (x_scale2 * q2, within half a step of x_scale2 ~ x_scale1 / 254), so the products see about 15 bits of each
// input instead of 8. Both passes run through the int8 jobs as one input of 2M rows (row m and row M + m);
// y = y1 + y2 (+ bias), each step rounded to float32 as quasar.quant.int8.Int8Linear's torch reference.
at::Tensor w8a8_residual_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2, "x [M, K] expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<at::Tensor> ws{w}, scales{w_scale}, none{at::empty({0}, x.options())};
  Int8Jobs made = int8_jobs(2 * M, K, ws, scales, none, x.options());
  const int64_t G = made.G ? made.G : K;
  check_quantizable(x, G);
  auto q = kernel_result({2 * M, K}, x.options().dtype(at::kChar));  // pass 1 in rows [0, M), pass 2 in [M, 2M)
  auto x_scale = kernel_result({2 * M, K / G}, x.options());
  auto residual = kernel_result({M, K}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *sp = x_scale.data_ptr<float>(), *rp = residual.data_ptr<float>();
  over_rows(M, K, [&](int64_t m0, int64_t m1) {
    quantize_rows(xp + m0 * K, m1 - m0, K, G, qp + m0 * K, sp + m0 * (K / G));
    for (int64_t i = m0 * K; i < m1 * K; ++i) rp[i] = xp[i] - static_cast<float>(qp[i]) * sp[i / G];
    quantize_rows(rp + m0 * K, m1 - m0, K, G, qp + (M + m0) * K, sp + (M + m0) * (K / G));
  });
  run_int8_jobs(linear_path(), qp, sp, made.jobs, 2 * M, K);
  auto y = made.out[0].narrow(0, 0, M) + made.out[0].narrow(0, M, M);
  if (bias.numel()) {
    TORCH_CHECK(bias.dtype() == at::kFloat && bias.numel() == y.size(1), "float32 bias [N] or empty expected");
    y += bias;
  }
  return y;
}

// ---- GGUF-block linears (block_linear.cpp) -------------------------------------------------------------------------

namespace {

constexpr int64_t kGroup = 32;

// A packed weight's kernel, after checking its panels [N/16, K/32, 256, 320 or 384] and block scales (4- and 5-bit:
// [N/16, K/B, 64 + B] for blocks of B inputs, or [N/16, K/32, 64] where every sc and m is 1; Q6_K: [N/16, K/256,
// 288]); B into *B, whether sc and m are left out into *unit.
BlockPanels check_blocks(const at::Tensor& w, const at::Tensor& scales, int64_t K, int64_t* B, bool* unit) {
  TORCH_CHECK(w.dtype() == at::kByte && w.dim() == 3 && w.size(1) * kGroup == K &&
                  (w.size(2) == 256 || w.size(2) == 320 || w.size(2) == 384),
              "block panels uint8 [N/16, K/32, 256 (4-bit), 320 (5-bit) or 384 (Q6_K)] expected for K = ", K);
  TORCH_CHECK(scales.dtype() == at::kByte && scales.dim() == 3 && scales.size(0) == w.size(0) && scales.size(1) > 0,
              "block scales uint8 [N/16, K/B, bytes] expected");
  if (w.size(2) == 384) {
    TORCH_CHECK(scales.size(2) == 288 && scales.size(1) * 256 == K, "Q6_K block scales [N/16, K/256, 288] expected");
    *B = 256;
    return w6a8_panels;
  }
  *unit = scales.size(2) == 64;
  *B = *unit ? kGroup : scales.size(2) - 64;
  TORCH_CHECK(*B > 0 && *B % kGroup == 0 && *B * scales.size(1) == K,
              "4-bit block scales [N/16, K/B, 64 + B] need a block size B that is a multiple of 32 dividing K = ", K);
  return w.size(2) == 320 ? w5a8_panels : w4a8_panels;
}

}  // namespace

// x [M, K] float32 quantized per 32 inputs once, times every weight's panels with its block scales, plus its bias, on
// the named int8 path ("current": the one every linear runs on now).
std::vector<at::Tensor> block_linear_on(const std::string& path, at::Tensor x, std::vector<at::Tensor> w,
                                           std::vector<at::Tensor> scales, std::vector<at::Tensor> bias) {
  TORCH_CHECK(w.size() == scales.size() && w.size() == bias.size() && !w.empty(), "one scale and one bias per weight");
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) % kGroup == 0, "float32 x [M, K], K % 32 == 0");
  x = x.contiguous();
  const Int8Path p = path == "current" ? linear_path() : parse_int8_path(path);
  const int64_t M = x.size(0), K = x.size(1);
  auto q = kernel_result({M, K}, x.options().dtype(at::kChar));
  auto x_scale = kernel_result({M, K / kGroup}, x.options());
  auto xsum = kernel_result({M, K / kGroup}, x.options().dtype(at::kInt));
  auto xsum16 = kernel_result({M, K / 16}, x.options().dtype(at::kInt));
  quantize_block_input(x.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), x_scale.data_ptr<float>(),
                       xsum.data_ptr<int32_t>(), xsum16.data_ptr<int32_t>());
  std::vector<BlockCall> calls;
  std::vector<BlockPanels> kernels;
  std::vector<const float*> bias_data;
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = w[i].contiguous();
    scales[i] = scales[i].contiguous();
    bias[i] = bias[i].contiguous();
    int64_t B = 0;
    bool unit = false;
    kernels.push_back(check_blocks(w[i], scales[i], K, &B, &unit));
    const int64_t N = w[i].size(0) * 16;
    TORCH_CHECK(bias[i].numel() == 0 || (bias[i].dtype() == at::kFloat && bias[i].numel() == N),
                "float32 bias [N] or empty expected");
    out.push_back(kernel_result({M, N}, x.options()));
    calls.push_back(BlockCall{q.data_ptr<int8_t>(), xsum.data_ptr<int32_t>(), xsum16.data_ptr<int32_t>(),
                              x_scale.data_ptr<float>(), w[i].data_ptr<uint8_t>(), scales[i].data_ptr<uint8_t>(), B,
                              unit, out.back().data_ptr<float>(), M, N, K});
    bias_data.push_back(data_or_null(bias[i]));
  }
  run_block_calls(p, calls, kernels, bias_data);
  return out;
}

std::vector<at::Tensor> block_linear_many(at::Tensor x, std::vector<at::Tensor> w,
                                             std::vector<at::Tensor> scales, std::vector<at::Tensor> bias) {
  return block_linear_on("current", x, std::move(w), std::move(scales), std::move(bias));
}

at::Tensor block_linear(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor bias) {
  return block_linear_many(x, {w}, {scales}, {bias})[0];
}

// ---- float-activation linears (float_dot.cpp) ----------------------------------------------------------------------

namespace {

void check_float_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t multiple) {
  TORCH_CHECK(x.dtype() == at::kFloat, "float32 x expected");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.size(1) % multiple == 0, "K must be a multiple of ", multiple);
  TORCH_CHECK(bias.numel() == 0 || (bias.dtype() == at::kFloat && bias.numel() == w.size(0)),
              "float32 bias [N] or empty expected");
}

// The packed products (bf16_linear_rounded, fp32_linear): x [M, K] times weights packed in panels of 16 channels:
// bfloat16 pairs [N/16, K/2, 16, 2] (x as bf16_input rounds it), float32 [N/16, K, 16] or bfloat16 [N/16, K, 16]
// (widened; x float32), plus bias [N] float32 or empty -> y [M, N] float32; one parallel region over the panels.
at::Tensor packed_linear(at::Tensor x, at::Tensor wp, at::Tensor bias) {
  const bool pairs = wp.dim() == 4;
  TORCH_CHECK(pairs ? wp.dtype() == at::kBFloat16 && wp.size(3) == 2 : wp.dim() == 3,
              "weights packed [N/16, K/2, 16, 2] (bfloat16 pairs) or [N/16, K, 16] (float32 or bfloat16) expected");
  TORCH_CHECK(wp.size(2) == 16, "panels of 16 channels expected");
  const int64_t K = pairs ? 2 * wp.size(1) : wp.size(1), N = 16 * wp.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.device().is_cpu(), "x [M, K] expected");
  TORCH_CHECK(pairs ? x.scalar_type() == bf16_input_dtype(K) : x.dtype() == at::kFloat,
              pairs ? "x rounded as bf16_input rounds it for this path expected" : "float32 x expected");
  TORCH_CHECK(bias.numel() == 0 || (bias.dtype() == at::kFloat && bias.numel() == N), "float32 bias [N] or empty expected");
  x = x.contiguous();
  wp = wp.contiguous();
  bias = bias.contiguous();
  auto y = kernel_result({x.size(0), N}, at::dtype(at::kFloat));
  packed_dot(x.data_ptr(), wp.data_ptr(), pairs, wp.dtype() == at::kBFloat16, data_or_null(bias), y.data_ptr<float>(),
             x.size(0), N, K);
  return y;
}

}  // namespace

// Float activations times float32, int8 (W8A16) or bfloat16 weights, float32 sums in a fixed order:
// x [M, K] float32, w [N, K], scale [N] float32 or empty, bias [N] float32 or empty
// -> y [M, N] float32 = (x . w[n]) * scale[n] + bias[n]. Row m of the result depends on x[m] only.
at::Tensor float_act_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor bias) {
  TORCH_CHECK(w.dtype() == at::kChar || w.dtype() == at::kBFloat16 || w.dtype() == at::kFloat,
              "float32, int8 or bfloat16 w expected");
  check_float_linear(x, w, bias, 16);
  x = x.contiguous();
  w = w.contiguous();
  scale = scale.contiguous();
  bias = bias.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(scale.numel() == 0 || (scale.dtype() == at::kFloat && scale.numel() == N),
              "float32 scale [N] or empty expected");
  auto y = kernel_result({M, N}, x.options());
  const WeightType type = w.dtype() == at::kChar    ? WeightType::Int8
                          : w.dtype() == at::kFloat ? WeightType::Float32
                                                    : WeightType::BFloat16;
  float_act_dot(x.data_ptr<float>(), w.data_ptr(), type, data_or_null(scale), data_or_null(bias), y.data_ptr<float>(), M,
                N, K);
  return y;
}

at::ScalarType bf16_input_dtype(int64_t K) { return bf16_rounded_as_float(K) ? at::kFloat : at::kBFloat16; }

void round_bf16_into(const float* x, int64_t count, at::Tensor& out, int64_t offset) {
  TORCH_CHECK(out.is_contiguous() && offset >= 0 && offset + count <= out.numel(), "the rounded values do not fit out");
  const bool as_float = out.dtype() == at::kFloat;
  round_bf16_to(x, count, static_cast<char*>(out.data_ptr()) + offset * (as_float ? 4 : 2), as_float);
}

at::Tensor bf16_input(at::Tensor x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.device().is_cpu(), "float32 x [M, K] expected");
  x = x.contiguous();
  auto out = kernel_result(x.sizes(), at::dtype(bf16_input_dtype(x.size(1))));
  const float* xp = x.data_ptr<float>();
  parallel_for(0, x.numel(), 1 << 16, [&](int64_t i0, int64_t i1) { round_bf16_into(xp + i0, i1 - i0, out, i0); });
  return out;
}

at::Tensor bf16_linear_rounded(at::Tensor xr, at::Tensor wp, at::Tensor bias) {
  TORCH_CHECK(wp.dtype() == at::kBFloat16 && wp.dim() == 4, "bfloat16 weights packed [N/16, K/2, 16, 2] expected");
  return packed_linear(xr, wp, bias);
}

// x [M, K] float32 rounded to bfloat16, times bfloat16 weights packed [N/16, K/2, 16, 2] (w[n, k] at
// [n / 16, k / 2, n % 16, k % 2]), float32 sums as vdpbf16ps takes them, plus bias [N] float32 (or empty)
// -> y [M, N] float32: the bf16 verifier. Row m of the result depends on x[m] only.
at::Tensor bf16_linear(at::Tensor x, at::Tensor wp, at::Tensor bias) {
  return bf16_linear_rounded(bf16_input(x), wp, bias);
}

// x [M, K] float32 times float32 or bfloat16 weights packed [N/16, K, 16] (w[n, k] at [n / 16, k, n % 16]),
// bfloat16 widened to float32 exactly, each output one float32 FMA chain in k order, plus bias [N] float32
// (or empty) -> y [M, N] float32: the fp32 verifier, and the bf16 lm_head of W8A8 checkpoints. Row m of the
// result depends on x[m] only.
at::Tensor fp32_linear(at::Tensor x, at::Tensor wp, at::Tensor bias) {
  TORCH_CHECK((wp.dtype() == at::kFloat || wp.dtype() == at::kBFloat16) && wp.dim() == 3,
              "float32 or bfloat16 weights packed [N/16, K, 16] expected");
  return packed_linear(x, wp, bias);
}

// ---- RMSNorm (norm_quant.cpp) --------------------------------------------------------------------------------------

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dtype() == at::kFloat && weight.dtype() == at::kFloat, "float32 x and weight expected");
  TORCH_CHECK(x.dim() == 2 && weight.numel() == x.size(1) && x.size(1) % 8 == 0, "x [M, K], weight [K], K % 8 == 0");
  x = x.contiguous();
  weight = weight.contiguous();
  auto y = kernel_result(x.sizes(), x.options());
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), x.size(0), x.size(1), eps, y.data_ptr<float>());
  return y;
}

// ---- logits (logits.cpp) -------------------------------------------------------------------------------------------

namespace {

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == at::kFloat && t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(),
              "contiguous float32 CPU ", what, " [R, V] expected");
}

}  // namespace

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dtype() == at::kFloat && logits.dim() == 2 && logits.device().is_cpu() && logits.size(1) > 0,
              "float32 CPU logits [R, V] expected");
  logits = logits.contiguous();
  auto out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  argmax_into(logits.data_ptr<float>(), logits.size(0), logits.size(1), out.data_ptr<int64_t>());
  return out;
}

std::vector<double> sampling_weights(at::Tensor logits, at::Tensor out, double inv_t) {
  check_rows(logits, "logits");
  check_rows(out, "weights");
  TORCH_CHECK(out.sizes() == logits.sizes(), "weights of the logits' shape expected");
  return sampling_weights_into(logits.data_ptr<float>(), out.data_ptr<float>(), logits.size(0), logits.size(1), inv_t);
}

std::vector<double> keep_weights(at::Tensor logits, at::Tensor weights, at::Tensor keep_from) {
  check_rows(logits, "logits");
  check_rows(weights, "weights");
  TORCH_CHECK(weights.sizes() == logits.sizes() && keep_from.dtype() == at::kFloat &&
              keep_from.numel() == logits.size(0), "weights of the logits' shape and one float32 threshold per row expected");
  keep_from = keep_from.contiguous();
  return keep_weights_into(logits.data_ptr<float>(), weights.data_ptr<float>(), keep_from.data_ptr<float>(),
                           logits.size(0), logits.size(1));
}

at::Tensor filter_cuts(at::Tensor logits, at::Tensor weights, int64_t top_k, double top_p) {
  check_rows(logits, "logits");
  check_rows(weights, "weights");
  TORCH_CHECK(weights.sizes() == logits.sizes(), "weights of the logits' shape expected");
  TORCH_CHECK(top_k >= 0 && top_p > 0 && top_p <= 1, "top_k >= 0 and top_p in (0, 1] expected");
  auto out = at::empty({logits.size(0), 1}, logits.options());
  filter_cuts_into(logits.data_ptr<float>(), weights.data_ptr<float>(), logits.size(0), logits.size(1), top_k, top_p,
                   out.data_ptr<float>());
  return out;
}

int64_t draw_index(at::Tensor weights, double u) {
  TORCH_CHECK(weights.dtype() == at::kFloat && weights.dim() == 1 && weights.is_contiguous() && weights.device().is_cpu(),
              "contiguous float32 CPU weights [V] expected");
  return draw_index_at(weights.data_ptr<float>(), weights.size(0), u);
}

// ---- attention (attention.cpp) -------------------------------------------------------------------------------------

CacheView cache_view(const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes(), "caches [L, H_kv, S, D] expected");
  TORCH_CHECK(k.dtype() == at::kFloat && v.dtype() == at::kFloat && k.is_contiguous() && v.is_contiguous() &&
              k.device().is_cpu() && v.device().is_cpu(), "contiguous float32 CPU caches expected");
  return CacheView{k.data_ptr<float>(), v.data_ptr<float>(), k.size(1), k.size(2), k.size(3)};
}

namespace {

at::Tensor attention(const AttentionSteps& steps, int64_t layer, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin) {
  for (const auto& t : {q, k, v, cos, sin})
    TORCH_CHECK(t.dtype() == at::kFloat && t.is_contiguous() && t.device().is_cpu(),
                "contiguous float32 CPU tensors expected");
  const int64_t T = q.size(0), H = steps.heads(), H_kv = steps.kv_heads(), D = steps.head_dim();
  TORCH_CHECK(q.size(1) == H * D && k.size(1) == H_kv * D && v.size(1) == H_kv * D, "bad head shapes");
  auto q_rot = kernel_result(q.sizes(), q.options()), out = kernel_result(q.sizes(), q.options());
  attend_steps(steps, layer, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), cos.data_ptr<float>(),
               sin.data_ptr<float>(), q_rot.data_ptr<float>(), out.data_ptr<float>(), T);
  return out;
}

}  // namespace

// q [T, H*D], k and v [T, H_kv*D], cos and sin [T, D], cache_k and cache_v [H_kv, S, D] (one layer, batch
// 0), all float32 -> out [T, H*D]. Writes the rotated k and v at cache positions [start, start + T). parents: empty,
// or the rows' parent rows (a draft tree, Segment::parents; cos and sin then at each row's own position).
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos,
                               at::Tensor sin, at::Tensor cache_k, at::Tensor cache_v, int64_t start,
                               bool bf16_products, int64_t window, double scale, std::vector<int64_t> parents) {
  TORCH_CHECK(cache_k.dim() == 3, "caches [H_kv, S, D] expected");  // cache_view checks the rest
  const int64_t D = cache_k.size(2);
  TORCH_CHECK(q.dim() == 2 && q.size(1) % D == 0, "q [T, H*D] expected");
  TORCH_CHECK(parents.empty() || static_cast<int64_t>(parents.size()) == q.size(0), "a tree's parents are one per row");
  const std::vector<Segment> one{Segment{cache_view(cache_k.unsqueeze(0), cache_v.unsqueeze(0)), start, q.size(0), {},
                                         parents.empty() ? nullptr : parents.data()}};
  return attention(AttentionSteps(one, q.size(0), q.size(1) / D, kernel_threads(), bf16_products, {window, scale}), 0,
                   q, k, v, cos, sin);
}

// The rows of several sequences one after another (q, k, v, cos, sin as decode_attention's, over all rows),
// segment i attending over layer `layer` of its own cache [L, H_kv, S, D] (checked by FusedLayers::forward_segments).
at::Tensor segment_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                                const std::vector<Segment>& segments, int64_t layer, bool bf16_products,
                                AttentionWindow shape, bool ring) {
  const int64_t D = segments.at(0).cache.D;
  TORCH_CHECK(q.dim() == 2 && q.size(1) % D == 0, "q [T, H*D] expected");
  return attention(AttentionSteps(segments, q.size(0), q.size(1) / D, kernel_threads(), bf16_products, shape, ring),
                   layer, q, k, v, cos, sin);
}
