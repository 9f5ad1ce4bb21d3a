// quasar's CPU kernels, as the other kernel files and bindings.cpp see them.
#pragma once
#include "aten.h"
#include "cpu.h"
#include "linear_kind.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

// A new, unwritten tensor like at::empty's, for a kernel to fill whole (result_pool.cpp): blocks of 1 MB and more are
// handed back to the next result of the same size instead of to malloc (a forward repeats its sizes every layer).
at::Tensor kernel_result(at::IntArrayRef sizes, const at::TensorOptions& options);
// Free every kept block (a server gone idle gives its memory back); returns the bytes freed.
int64_t release_results();

at::Tensor w8a8_linear(at::Tensor x, at::Tensor w, at::Tensor w_scale, at::Tensor bias);
std::vector<at::Tensor> w8a8_linear_many(at::Tensor x, std::vector<at::Tensor> w,
                                            std::vector<at::Tensor> w_scale, std::vector<at::Tensor> bias);
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
// One row of rms_norm (y may be x), and quantize_tokens on each group of G values (G % 16 == 0) of x [M, K] -> q
// [M, K], scale [M, K / G]: the row operations of the W8A8 linears (norm_quant.cpp), for packed_w8a8_step.cpp too.
void norm_row(const float* x, const float* weight, int64_t K, double eps, float* y);
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int8_t* q, float* scale);
// logits [R, V] float32 -> torch.argmax(logits, -1) (logits.cpp).
at::Tensor argmax_rows(at::Tensor logits);
// Sampling at temperature > 0 (logits.cpp, quasar.decoding.sampling): the weights exp((logits - max) * inv_t) and their row
// sums, the filters' cut, and one draw by the running float64 sum.
std::vector<double> sampling_weights(at::Tensor logits, at::Tensor out, double inv_t);
at::Tensor filter_cuts(at::Tensor logits, at::Tensor weights, int64_t top_k, double top_p);
std::vector<double> keep_weights(at::Tensor logits, at::Tensor weights, at::Tensor keep_from);
int64_t draw_index(at::Tensor weights, double u);
// bf16_products: the step's linears take bfloat16 inputs (the bf16 verifier): then attention too runs on bfloat16
// products where bf16_attention says so (attention_amx.cpp).
// window: a sliding-window layer's (each query sees its last `window` positions), 0 for causal attention over the
// whole cache; scale: the scores' (0: head_dim^-1/2).
struct AttentionWindow {
  int64_t window = 0;
  double scale = 0;
};
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor cos,
                               at::Tensor sin, at::Tensor cache_k, at::Tensor cache_v, int64_t start,
                               bool bf16_products, int64_t window, double scale);
// One sequence's rows inside a call over several: its cache [L, H_kv, S, D], positions filled, row count, and where
// its sliding-window layers keep their keys in rings (attention.cpp), those: [L_sliding, H_kv, 2 R, D] (R % 32 == 0),
// cache_k then holding the other layers only (undefined: every layer in cache_k).
struct Segment {
  at::Tensor cache_k, cache_v;
  int64_t start, rows;
  at::Tensor ring_k = {}, ring_v = {};
};
// Rope, cache writes and attention of one step's rows over their sequences' caches (attention.cpp), in parts any
// thread may run: rope(t0, t1) for every row first, then attend(i) for each work item i < items(), in any order and
// on any thread (the results never depend on which runs what). Built once per step, for every layer.
class AttentionSteps {
 public:
  // segments' caches [L, H_kv, S, D] (contiguous float32), T rows of H query heads; threads: how many share the items;
  // bf16_products as decode_attention's.
  // ring: the layer reads the segments' rings (a sliding-window layer's).
  AttentionSteps(const std::vector<Segment>& segments, int64_t T, int64_t H, int64_t threads, bool bf16_products = false,
                 AttentionWindow shape = {}, bool ring = false);
  ~AttentionSteps();
  AttentionSteps(const AttentionSteps&) = delete;
  AttentionSteps& operator=(const AttentionSteps&) = delete;
  int64_t items() const { return static_cast<int64_t>(items_.size()); }
  int64_t heads() const { return H_; }
  int64_t kv_heads() const { return H_kv_; }
  int64_t head_dim() const { return D_; }
  // q [T, H*D], k and v [T, H_kv*D], cos and sin [T, D]: rows [t0, t1) of q_rot [T, H*D] (q rotated), and the rows'
  // rotated keys and their values written into layer `layer` of their caches.
  void rope(int64_t layer, const float* q, const float* k, const float* v, const float* cos, const float* sin,
            float* q_rot, int64_t t0, int64_t t1) const;
  // Work item i of layer `layer`: its rows of out [T, H*D] from q_rot and the caches (scores: the caller's scratch).
  void attend(int64_t layer, int64_t i, const float* q_rot, float* out, std::vector<float>& scores) const;
  // Where the attention runs on AMX: part i < packs() of layer `layer`'s keys and values packed into the bfloat16
  // tiles attend reads, each part once, after rope and before attend (packs() is 0 otherwise). The steps of one
  // thread share its pack buffer: one AttentionSteps on AMX at a time per thread (checked).
  int64_t packs() const { return static_cast<int64_t>(packs_.size()); }
  void pack(int64_t layer, int64_t i) const;

 private:
  struct View {  // one sequence: its caches, a layer's size in them, its rows [row0, row0 + rows) at positions start..,
    float *k, *v;  // its ring's R (0: a plain cache) and the first position its rows read, rounded down to a block of 32
    int64_t layer_size, S, start, row0, rows, ring, origin;
  };
  // Where kv head kv's key at the view's origin is in layer `layer` of its caches: the keys from there to the rows'
  // last lie side by side (in a ring, from its first copy).
  int64_t from_origin(const View& v, int64_t layer, int64_t kv) const {
    return layer * v.layer_size + (kv * v.S + (v.ring ? v.origin % v.ring : v.origin)) * D_;
  }
  struct Item {  // rows [first, first + count) of one kv head of one view (row r: token r / group, head r % group)
    int64_t view, kv, first, count, keys;  // keys: the key rows its rows read in all, its cost
  };
  // The first key a query at position pos sees.
  int64_t first_key(int64_t pos) const { return window_ ? std::max<int64_t>(0, pos - window_ + 1) : 0; }

  std::vector<View> views_;
  std::vector<int64_t> row_view_;  // the view of each row
  std::vector<Item> items_;
  int64_t H_, H_kv_ = 0, D_ = 0, window_ = 0;
  float scale_ = 0;
  bool wide_ = false;  // AVX-512 attention (float_path_avx512, D % 64 == 0)
  bool amx_ = false;   // bfloat16 attention on AMX tiles (bf16_attention)
  struct Pack {        // 32 keys and values of one kv head of one view
    int64_t view, kv, block;
  };
  struct Packed {  // one view's packed keys and values: per kv head `size` of each, from shared_ + at (-1: by its items)
    int64_t size, at;
  };
  std::vector<Pack> packs_;
  std::vector<Packed> packed_;
  uint16_t* shared_ = nullptr;
  static int& live_on_thread();  // AttentionSteps on AMX alive on this thread (at most one: they share shared_)
};
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
  at::Tensor forward_segments(at::Tensor x, std::vector<at::Tensor> rope,
                                 std::vector<at::Tensor> caches_k, std::vector<at::Tensor> caches_v,
                                 std::vector<at::Tensor> rings_k, std::vector<at::Tensor> rings_v,
                                 std::vector<int64_t> starts, std::vector<int64_t> rows) const;
  // rope_tables: cos, sin [L, D] of positions 0 .. L - 1, then the sliding-window layers' own pair if any.
  at::Tensor forward_tokens(std::vector<int64_t> ids, at::Tensor embedding, std::vector<at::Tensor> rope_tables,
                               std::vector<at::Tensor> caches_k, std::vector<at::Tensor> caches_v,
                               std::vector<at::Tensor> rings_k, std::vector<at::Tensor> rings_v,
                               std::vector<int64_t> starts, std::vector<int64_t> rows,
                               std::vector<int64_t> picked) const;
  // Whether a step of this many rows runs every layer in one parallel region (packed_w8a8_step.cpp).
  bool one_region(int64_t rows) const;

 private:
  // The segments of the caches (checked), with rows[i] rows each, `total` in all.
  std::vector<Segment> segments(const std::vector<at::Tensor>& caches_k, const std::vector<at::Tensor>& caches_v,
                                const std::vector<at::Tensor>& rings_k, const std::vector<at::Tensor>& rings_v,
                                const std::vector<int64_t>& starts, const std::vector<int64_t>& rows, int64_t total) const;

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
