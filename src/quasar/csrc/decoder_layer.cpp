// One whole decoder layer of a decode or verify step (a few new tokens, batch 1) in one call: the same
// kernels the Python layer calls one by one (RMSNorm, linears, attention) plus ATen's silu, multiply and
// add, without the ~40 Python-level operations per layer in between. FusedLayers runs all layers of a
// model in one call, with their tensors handed over once instead of at every step.
//
// x [T, hidden] float32. t holds, in order: input norm weight, post-attention norm weight, q-norm and
// k-norm weights (empty without qk-norm), then weight, scale and bias for q, k, v, o, gate, up, down
// (scale or bias empty where absent). kinds[i] says how linear i runs: 0 = W8A8 (int8 weight, per-token
// int8 activations), 1 = float activations (int8 weight with per-channel scale, or bfloat16 weight).
#include "kernels.h"

namespace {

torch::Tensor linear(int64_t kind, const torch::Tensor& x, const std::vector<torch::Tensor>& t, int i) {
  const torch::Tensor &w = t[4 + 3 * i], &scale = t[5 + 3 * i], &bias = t[6 + 3 * i];
  return kind == 0 ? w8a8_linear(x, w, scale, bias) : float_act_linear(x, w, scale, bias);
}

// Linears `first`.. of the same input; W8A8 ones share one activation quantization.
std::vector<torch::Tensor> linears(const torch::Tensor& x, const std::vector<torch::Tensor>& t,
                                   const std::vector<int64_t>& kinds, std::vector<int> which) {
  bool all_w8a8 = true;
  for (int i : which) all_w8a8 = all_w8a8 && kinds[i] == 0;
  if (!all_w8a8) {
    std::vector<torch::Tensor> out;
    for (int i : which) out.push_back(linear(kinds[i], x, t, i));
    return out;
  }
  std::vector<torch::Tensor> w, scale, bias;
  for (int i : which) {
    w.push_back(t[4 + 3 * i]);
    scale.push_back(t[5 + 3 * i]);
    bias.push_back(t[6 + 3 * i]);
  }
  return w8a8_linear_many(x, w, scale, bias);
}

}  // namespace

torch::Tensor decoder_layer(torch::Tensor x, std::vector<torch::Tensor> t, std::vector<int64_t> kinds, double eps,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor cache_k, torch::Tensor cache_v,
                            int64_t start) {
  TORCH_CHECK(t.size() == 4 + 3 * 7 && kinds.size() == 7, "4 norm tensors, then 7 x (weight, scale, bias)");
  const int64_t T = x.size(0), D = cache_k.size(2);
  auto qkv = linears(rms_norm(x, t[0], eps), t, kinds, {0, 1, 2});
  auto q = qkv[0], k = qkv[1];
  if (t[2].numel()) {  // qk-norm (qwen3): per head, before rope
    q = rms_norm(q.view({-1, D}), t[2], eps).view({T, -1});
    k = rms_norm(k.view({-1, D}), t[3], eps).view({T, -1});
  }
  auto attended = decode_attention(q, k, qkv[2], cos, sin, cache_k, cache_v, start);
  x = x + linear(kinds[3], attended, t, 3);
  auto gate_up = linears(rms_norm(x, t[1], eps), t, kinds, {4, 5});
  return x + linear(kinds[6], torch::silu(gate_up[0]) * gate_up[1], t, 6);
}

FusedLayers::FusedLayers(std::vector<std::vector<torch::Tensor>> tensors, std::vector<std::vector<int64_t>> kinds,
                         double eps)
    : tensors_(std::move(tensors)), kinds_(std::move(kinds)), eps_(eps) {
  TORCH_CHECK(tensors_.size() == kinds_.size(), "one kinds list per layer");
}

// x [T, hidden]; cache_k and cache_v [L, H_kv, S, D] (batch 0 of a KVCache) -> the last layer's output.
torch::Tensor FusedLayers::forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor cache_k,
                                   torch::Tensor cache_v, int64_t start) const {
  TORCH_CHECK(cache_k.dim() == 4 && cache_k.size(0) == static_cast<int64_t>(tensors_.size()), "cache [L, H_kv, S, D] expected");
  for (size_t i = 0; i < tensors_.size(); ++i)
    x = decoder_layer(x, tensors_[i], kinds_[i], eps_, cos, sin, cache_k[i], cache_v[i], start);
  return x;
}
