// The linears of GGUF's quantized blocks (W4A8: Q4_0, Q4_1, Q4_K, Q5_K; W6A8: Q6_K): dynamic int8 activations, one scale
// per 32 inputs (quantized by norm_quant.cpp as the group-wise W8A8 linears quantize theirs), their sums per 32 and
// per 16 inputs, then the panel kernels (w4a8_panel.cpp, w6a8_panel.cpp) over every output panel of every weight in
// one parallel region, and the bias. A weight's panels say its format: [N/16, K/32, 256] 4-bit, [.., 320] 5-bit,
// [.., 384] Q6_K.
#include "kernels.h"
#include "block_panels.h"

#include <ATen/Parallel.h>

namespace {

constexpr int64_t kGroup = 32;

using Panels = void (*)(Int8Path, const BlockCall&, int64_t, int64_t);

// A packed weight's kernel, after checking its panels [N/16, K/32, 256, 320 or 384] and block scales (4- and 5-bit:
// [N/16, K/B, 64 + B] for blocks of B inputs; Q6_K: [N/16, K/256, 288]); B into *B.
Panels check_blocks(const at::Tensor& w, const at::Tensor& scales, int64_t K, int64_t* B) {
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
  *B = scales.size(2) - 64;
  TORCH_CHECK(*B > 0 && *B % kGroup == 0 && *B * scales.size(1) == K,
              "4-bit block scales [N/16, K/B, 64 + B] need a block size B that is a multiple of 32 dividing K = ", K);
  return w.size(2) == 320 ? w5a8_panels : w4a8_panels;
}

}  // namespace

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
  over_rows(M, K, [&](int64_t m0, int64_t m1) {
    quantize_rows(x.data_ptr<float>() + m0 * K, m1 - m0, K, kGroup, q.data_ptr<int8_t>() + m0 * K,
                  x_scale.data_ptr<float>() + m0 * (K / kGroup));
    int32_t* sums16 = xsum16.data_ptr<int32_t>() + m0 * (K / 16);
    int32_t* sums = xsum.data_ptr<int32_t>() + m0 * (K / kGroup);
    group_sums(q.data_ptr<int8_t>() + m0 * K, m1 - m0, K, 16, sums16);  // one pass; a group's sum is its halves'
    for (int64_t g = 0; g < (m1 - m0) * (K / kGroup); ++g) sums[g] = sums16[2 * g] + sums16[2 * g + 1];
  });
  std::vector<BlockCall> calls;
  std::vector<Panels> kernels;
  std::vector<at::Tensor> out;
  std::vector<int64_t> first{0};
  for (size_t i = 0; i < w.size(); ++i) {
    w[i] = w[i].contiguous();
    scales[i] = scales[i].contiguous();
    bias[i] = bias[i].contiguous();
    int64_t B = 0;
    kernels.push_back(check_blocks(w[i], scales[i], K, &B));
    const int64_t N = w[i].size(0) * 16;
    TORCH_CHECK(bias[i].numel() == 0 || (bias[i].dtype() == at::kFloat && bias[i].numel() == N),
                "float32 bias [N] or empty expected");
    out.push_back(kernel_result({M, N}, x.options()));
    calls.push_back(BlockCall{q.data_ptr<int8_t>(), xsum.data_ptr<int32_t>(), xsum16.data_ptr<int32_t>(),
                              x_scale.data_ptr<float>(), w[i].data_ptr<uint8_t>(), scales[i].data_ptr<uint8_t>(), B,
                              out.back().data_ptr<float>(), M, N, K});
    first.push_back(first.back() + w[i].size(0));
  }
  if (M == 0) return out;
  at::parallel_for(0, first.back(), 1, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < calls.size(); ++i) {
      const int64_t p0 = std::max(a, first[i]) - first[i], p1 = std::min(b, first[i + 1]) - first[i];
      if (p0 >= p1) continue;
      kernels[i](p, calls[i], p0, p1);
      if (!bias[i].numel()) continue;
      const float* bp = bias[i].data_ptr<float>();
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 16 * p0; n < 16 * p1; ++n) calls[i].y[m * calls[i].N + n] += bp[n];
    }
  });
  return out;
}

std::vector<at::Tensor> block_linear_many(at::Tensor x, std::vector<at::Tensor> w,
                                             std::vector<at::Tensor> scales, std::vector<at::Tensor> bias) {
  return block_linear_on("current", x, std::move(w), std::move(scales), std::move(bias));
}

at::Tensor block_linear(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor bias) {
  return block_linear_many(x, {w}, {scales}, {bias})[0];
}
