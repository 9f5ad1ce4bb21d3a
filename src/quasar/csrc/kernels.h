// quasar's CPU kernels, as the other kernel files and bindings.cpp see them.
#pragma once
#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor w8a8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor w_scale, torch::Tensor bias);
std::vector<torch::Tensor> w8a8_linear_many(torch::Tensor x, std::vector<torch::Tensor> w,
                                            std::vector<torch::Tensor> w_scale, std::vector<torch::Tensor> bias);
torch::Tensor int8_mm(torch::Tensor x, torch::Tensor w, const std::string& path);
// Chooses the int8 path of every later W8A8 linear ("auto" or one of int8_paths()); returns its name.
std::string use_int8_path(const std::string& name);
std::string int8_path();  // the path W8A8 linears run on now
// Chooses how the dpbusd loops prefetch weights ("auto": l2 on AMD CPUs, l1 elsewhere; see blocking.h);
// returns its name. prefetch() names the policy now.
std::string use_prefetch(const std::string& name);
std::string prefetch();
torch::Tensor int8_group_mm(torch::Tensor q, torch::Tensor x_scale, torch::Tensor w, torch::Tensor w_scale,
                            const std::string& path);
// Float-activation linears (float_dot.cpp): float32 x times float32, bfloat16 or int8 w (float_act_linear);
// x rounded to bfloat16 times bfloat16 w packed in panels of 16 channels, as vdpbf16ps sums (bf16_linear).
// Same floats on every path.
torch::Tensor float_act_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias);
// float32 x times float32 w packed in panels of 16 channels, one FMA chain per output (fp32_linear).
torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias);
std::vector<std::string> float_paths();  // this CPU's: "avx512bf16", "avx512", "avx2", fastest first
std::string use_float_path(const std::string& name);  // "auto" or one of float_paths(); returns its name
std::string float_path();  // the path float-activation linears run on now
bool float_path_avx512();  // whether that path has 512-bit registers (attention follows it)
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
// logits [R, V] float32 -> torch.argmax(logits, -1) (logits.cpp).
torch::Tensor argmax_rows(torch::Tensor logits);
// Sampling at temperature > 0 (logits.cpp, quasar.sampling): the weights exp((logits - max) * inv_t) and their row
// sums, the filters' cut, and one draw by the running float64 sum.
std::vector<double> sampling_weights(torch::Tensor logits, torch::Tensor out, double inv_t);
torch::Tensor filter_cuts(torch::Tensor logits, torch::Tensor weights, int64_t top_k, double top_p);
std::vector<double> keep_weights(torch::Tensor logits, torch::Tensor weights, torch::Tensor keep_from);
int64_t draw_index(torch::Tensor weights, double u);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos,
                               torch::Tensor sin, torch::Tensor cache_k, torch::Tensor cache_v, int64_t start);
// One sequence's rows inside a call over several: its cache [L, H_kv, S, D], positions filled, row count.
struct Segment {
  torch::Tensor cache_k, cache_v;
  int64_t start, rows;
};
// decode_attention for the rows of several sequences, each over layer `layer` of its own cache (caches checked
// by the caller: contiguous float32 [L, H_kv, S, D], one H_kv and D).
torch::Tensor segment_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor cos, torch::Tensor sin,
                                const std::vector<Segment>& segments, int64_t layer);
// One decoder layer (decoder_layer.cpp) over the rows of the segments, layer `layer` of each one's cache.
torch::Tensor decoder_layer(torch::Tensor x, const std::vector<torch::Tensor>& t, const std::vector<int64_t>& kinds,
                            double eps, const torch::Tensor& cos, const torch::Tensor& sin,
                            const std::vector<Segment>& segments, int64_t layer);

// All decoder layers of one model (see decoder_layer): built once, then one call per forward.
class FusedLayers {
 public:
  // head: empty, or the final norm's weight and the lm_head's weight, scale and bias (head_kind: a linear kind).
  FusedLayers(std::vector<std::vector<torch::Tensor>> tensors, std::vector<std::vector<int64_t>> kinds, double eps,
              std::vector<torch::Tensor> head, int64_t head_kind);
  torch::Tensor forward_segments(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                 std::vector<torch::Tensor> caches_k, std::vector<torch::Tensor> caches_v,
                                 std::vector<int64_t> starts, std::vector<int64_t> rows) const;
  torch::Tensor forward_tokens(std::vector<int64_t> ids, torch::Tensor embedding, torch::Tensor cos_table,
                               torch::Tensor sin_table, std::vector<torch::Tensor> caches_k,
                               std::vector<torch::Tensor> caches_v, std::vector<int64_t> starts,
                               std::vector<int64_t> rows, std::vector<int64_t> picked) const;

 private:
  std::vector<std::vector<torch::Tensor>> tensors_;
  std::vector<std::vector<int64_t>> kinds_;
  double eps_;
  std::vector<torch::Tensor> head_;
  int64_t head_kind_;
};
