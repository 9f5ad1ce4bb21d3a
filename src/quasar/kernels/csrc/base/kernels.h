// quasar's CPU kernels on tensors, as bindings.cpp and the layer files (decoder_layer.cpp, packed_w8a8_step.cpp) see
// them: tensors.cpp checks each operation's tensors, makes its results and calls the kernel on their pointers
// (kernel_ops.h).
#pragma once
#include "aten.h"
#include "kernel_ops.h"
#include "linear_kind.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// A new, unwritten tensor like at::empty's, for a kernel to fill whole (result_pool.cpp): blocks of 1 MB and more are
// handed back to the next result of the same size instead of to malloc (a forward repeats its sizes every layer).
at::Tensor kernel_result(at::IntArrayRef sizes, const at::TensorOptions& options);

at::Tensor w8a8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor bias);
std::vector<at::Tensor> w8a8_linear_many(at::Tensor x, std::vector<at::Tensor> w,
                                            std::vector<at::Tensor> w_scale, std::vector<at::Tensor> bias);
// w8a8_linear with the activations in two int8 passes, the second on the first's rounding residual (tensors.cpp).
at::Tensor w8a8_residual_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor bias);
// The linears of GGUF blocks (block_linear.cpp; W4A8 and W6A8): x [M, K] float32 quantized per 32 inputs, times
// 4-bit or Q6_K weights packed in panels [N/16, K/32, 256 or 384] uint8 with their block scales (uint8), plus bias [N]
// (or empty). _many quantizes x once for several weights; _on runs a named int8 path ("auto", one of int8_paths(), or
// "current").
at::Tensor block_linear(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor bias);
std::vector<at::Tensor> block_linear_many(at::Tensor x, std::vector<at::Tensor> w,
                                             std::vector<at::Tensor> scales, std::vector<at::Tensor> bias);
std::vector<at::Tensor> block_linear_on(const std::string& path, at::Tensor x, std::vector<at::Tensor> w,
                                           std::vector<at::Tensor> scales, std::vector<at::Tensor> bias);
at::Tensor int8_mm(at::Tensor x, at::Tensor w, const std::string& path);
at::Tensor int8_group_mm(at::Tensor q, at::Tensor x_scale, at::Tensor w, at::Tensor w_scale,
                            const std::string& path);
// Float-activation linears (float_dot.cpp): float32 x times float32, bfloat16 or int8 w (float_act_linear);
// x rounded to bfloat16 times bfloat16 w packed in panels of 16 channels, as vdpbf16ps sums (bf16_linear).
// Same floats on every path, but for bf16_linear on "amx" (AMX-BF16 tiles: tdpbf16ps's sums).
at::Tensor float_act_linear(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor bias);
at::Tensor bf16_linear(at::Tensor x, at::Tensor w, at::Tensor bias);
// bf16_linear in two steps, for an input several linears share or one rounded in pieces (decoder_layer.cpp): x rounded
// as the current float path's bf16 products take it (bf16_input_dtype(K): bfloat16 bits, or float32 numbers where the
// path runs them on FMAs), then multiplied (bf16_linear_rounded); round_bf16_into rounds count floats into such an
// input at element offset. bf16_linear(x, w, b) == bf16_linear_rounded(bf16_input(x), w, b), bit for bit.
at::ScalarType bf16_input_dtype(int64_t K);
at::Tensor bf16_input(at::Tensor x);
void round_bf16_into(const float* x, int64_t count, at::Tensor& out, int64_t offset);
at::Tensor bf16_linear_rounded(at::Tensor xr, at::Tensor w, at::Tensor bias);
// float32 x times float32 w packed in panels of 16 channels, one FMA chain per output (fp32_linear).
at::Tensor fp32_linear(at::Tensor x, at::Tensor w, at::Tensor bias);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
// logits [R, V] float32 -> torch.argmax(logits, -1) (logits.cpp).
at::Tensor argmax_rows(at::Tensor logits);
// Sampling at temperature > 0 (logits.cpp, quasar.decoding.sampling): the weights exp((logits - max) * inv_t) and their row
// sums, the filters' cut, and one draw by the running float64 sum.
std::vector<double> sampling_weights(at::Tensor logits, at::Tensor out, double inv_t);
at::Tensor filter_cuts(at::Tensor logits, at::Tensor weights, int64_t top_k, double top_p);
std::vector<double> keep_weights(at::Tensor logits, at::Tensor weights, at::Tensor keep_from);
int64_t draw_index(at::Tensor weights, double u);
// Attention over one cache [H_kv, S, D] (decode_attention) or over each segment's (segment_attention; kernel_ops.h's
// AttentionSteps). bf16_products: the step's linears take bfloat16 inputs (the bf16 verifier).
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos,
                               at::Tensor sin, at::Tensor cache_k, at::Tensor cache_v, int64_t start,
                               bool bf16_products, int64_t window, double scale, std::vector<int64_t> parents);
// The CacheView of a pair of caches: contiguous float32 [L, H_kv, S, D] (checked).
CacheView cache_view(const at::Tensor& k, const at::Tensor& v);
// decode_attention for the rows of several sequences, each over layer `layer` of its own cache (caches checked
// by the caller: contiguous float32 [L, H_kv, S, D], one H_kv and D).
at::Tensor segment_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos, at::Tensor sin,
                                const std::vector<Segment>& segments, int64_t layer, bool bf16_products,
                                AttentionWindow shape = {}, bool ring = false);
// cos and sin [N, D] of a step's rows: the model's, and where its sliding-window layers have their own frequencies
// (Gemma 3) theirs (local_cos, local_sin; undefined otherwise).
struct StepRope {
  at::Tensor cos, sin, local_cos, local_sin;
};
// One decoder layer (decoder_layer.cpp) over the rows of the segments, layer `layer` of each one's cache (of its ring,
// with ring).
at::Tensor decoder_layer(at::Tensor x, const LayerWeights& w, double eps, const StepRope& rope,
                            const std::vector<Segment>& segments, int64_t layer, bool ring = false);

// Every layer of a small step in one parallel region, for Llama-family models whose linears are all packed W8A8
// (packed_w8a8_step.cpp): plan_region is nullptr for any other model (Gemma's layers included); run_region gives bitwise decoder_layer's results,
// then the logits of the picked rows where the plan holds the head (else the hidden states).
struct RegionPlan;
std::shared_ptr<const RegionPlan> plan_region(const std::vector<LayerWeights>& layers,
                                              const std::optional<HeadWeights>& head);
bool region_runs(const RegionPlan& plan, int64_t rows);  // whether run_region takes a step of this many rows
bool region_has_head(const RegionPlan& plan);
at::Tensor run_region(const RegionPlan& plan, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<Segment>& segments, double eps, const std::vector<int64_t>* picked);

// All decoder layers of one model (see decoder_layer): built once, then one call per forward.
class FusedLayers {
 public:
  // head: the final norm and the lm_head, or none (forward_tokens then refuses).
  FusedLayers(std::vector<LayerWeights> layers, double eps, std::optional<HeadWeights> head);
  // rope: cos, sin [N, D] of x's rows, then the sliding-window layers' own pair where the model has one (Gemma 3).
  // rings_k, rings_v: empty, or one ring per segment holding the sliding-window layers' keys (Segment).
  // trees: empty, or per segment its rows' parent rows (Segment::parents; empty: a chain).
  at::Tensor forward_segments(at::Tensor x, std::vector<at::Tensor> rope,
                                 std::vector<at::Tensor> caches_k, std::vector<at::Tensor> caches_v,
                                 std::vector<at::Tensor> rings_k, std::vector<at::Tensor> rings_v,
                                 std::vector<int64_t> starts, std::vector<int64_t> rows,
                                 std::vector<std::vector<int64_t>> trees) const;
  // rope_tables: cos, sin [L, D] of positions 0 .. L - 1, then the sliding-window layers' own pair if any.
  at::Tensor forward_tokens(std::vector<int64_t> ids, at::Tensor embedding, std::vector<at::Tensor> rope_tables,
                               std::vector<at::Tensor> caches_k, std::vector<at::Tensor> caches_v,
                               std::vector<at::Tensor> rings_k, std::vector<at::Tensor> rings_v,
                               std::vector<int64_t> starts, std::vector<int64_t> rows,
                               std::vector<int64_t> picked, std::vector<std::vector<int64_t>> trees) const;
  // Whether a step of this many rows runs every layer in one parallel region (packed_w8a8_step.cpp).
  bool one_region(int64_t rows) const;

 private:
  // The segments of the caches (checked), with rows[i] rows each, `total` in all.
  std::vector<Segment> segments(const std::vector<at::Tensor>& caches_k, const std::vector<at::Tensor>& caches_v,
                                const std::vector<at::Tensor>& rings_k, const std::vector<at::Tensor>& rings_v,
                                const std::vector<int64_t>& starts, const std::vector<int64_t>& rows, int64_t total,
                                const std::vector<std::vector<int64_t>>& trees) const;

  // The StepRope of 2 or 4 tensors (checked: 4 where a layer takes the local pair; a model with a local pair may give it
  // when none of its layers takes it).
  StepRope step_rope(const std::vector<at::Tensor>& rope, int64_t rows) const;

  std::vector<LayerWeights> layers_;
  double eps_;
  bool local_rope_ = false;  // some layer takes the sliding-window layers' rope
  int64_t rings_ = 0, plains_ = 0;  // layers with a window (kept in rings where the caches have them), the others
  std::vector<int64_t> index_;      // each layer's place among those of its kind
  std::optional<HeadWeights> head_;
  std::shared_ptr<const RegionPlan> region_;  // nullptr: not all packed W8A8, or not the Llama family's layers
};
