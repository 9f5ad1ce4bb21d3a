// The linears of GGUF's quantized blocks (W4A8: Q4_0, Q4_1, Q4_K, Q5_K; W6A8: Q6_K): dynamic int8 activations, one scale
// per 32 inputs (quantized by norm_quant.cpp as the group-wise W8A8 linears quantize theirs), their sums per 32 and
// per 16 inputs, then the panel kernels (w4a8_layout.h, w6a8_layout.h) over every output panel of every weight in
// one parallel region, and the bias. A weight's panels say its format: [N/16, K/32, 256] 4-bit, [.., 320] 5-bit,
// [.., 384] Q6_K.
#include "kernel_ops.h"
#include "w4a8_layout.h"
#include "w6a8_layout.h"

void group_sums(const int8_t* x, int64_t M, int64_t K, int64_t G, int32_t* xsum) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < K / G; ++g) {
      int32_t sum = 0;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += x[m * K + k];
      xsum[m * (K / G) + g] = sum;
    }
}

void w4a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1) {
  if (path == Int8Path::Dpbusd) w4a8_dpbusd_panels(false, call, p0, p1);
  else w4a8_maddubs_panels(false, call, p0, p1);
}

void w5a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1) {
  if (path == Int8Path::Dpbusd) w4a8_dpbusd_panels(true, call, p0, p1);
  else w4a8_maddubs_panels(true, call, p0, p1);
}

void w6a8_panels(Int8Path path, const BlockCall& call, int64_t p0, int64_t p1) {
  if (path == Int8Path::Dpbusd) w6a8_dpbusd_panels(call, p0, p1);
  else w6a8_maddubs_panels(call, p0, p1);
}

void quantize_block_input(const float* x, int64_t M, int64_t K, int8_t* q, float* x_scale, int32_t* xsum,
                          int32_t* xsum16) {
  constexpr int64_t kGroup = 32;
  over_rows(M, K, [&](int64_t m0, int64_t m1) {
    quantize_rows(x + m0 * K, m1 - m0, K, kGroup, q + m0 * K, x_scale + m0 * (K / kGroup));
    int32_t* sums16 = xsum16 + m0 * (K / 16);
    int32_t* sums = xsum + m0 * (K / kGroup);
    group_sums(q + m0 * K, m1 - m0, K, 16, sums16);  // one pass; a group's sum is its halves'
    for (int64_t g = 0; g < (m1 - m0) * (K / kGroup); ++g) sums[g] = sums16[2 * g] + sums16[2 * g + 1];
  });
}

void run_block_calls(Int8Path path, const std::vector<BlockCall>& calls, const std::vector<BlockPanels>& kernels,
                     const std::vector<const float*>& bias) {
  std::vector<int64_t> first{0};
  for (const BlockCall& call : calls) first.push_back(first.back() + call.N / 16);
  if (calls.empty() || calls[0].M == 0) return;
  parallel_for(0, first.back(), 1, [&](int64_t a, int64_t b) {
    for (size_t i = 0; i < calls.size(); ++i) {
      const int64_t p0 = std::max(a, first[i]) - first[i], p1 = std::min(b, first[i + 1]) - first[i];
      if (p0 >= p1) continue;
      kernels[i](path, calls[i], p0, p1);
      if (!bias[i]) continue;
      for (int64_t m = 0; m < calls[i].M; ++m)
        for (int64_t n = 16 * p0; n < 16 * p1; ++n) calls[i].y[m * calls[i].N + n] += bias[i][n];
    }
  });
}
