// quasar's CPU kernels on plain pointers and sizes, no torch types: the arrays are contiguous and already checked by
// their caller (tensors.cpp for the Python-facing operations, decoder_layer.cpp and packed_w8a8_step.cpp for a
// layer's). Each file named below holds the operation; docs/kernels.md says which runs where.
#pragma once
#include "block_panels.h"
#include "cpu.h"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

// ---- result blocks (result_pool.cpp) -------------------------------------------------------------------------------
// A forward asks for the same result sizes layer after layer: a dead result's block of 1 MB or more is handed to the
// next result of the same size. pooled_size: the bytes a result of `size` bytes takes from the pool (0: it is small,
// malloc's own). take_block: a 64-byte aligned block of that many bytes; give_back: the block is dead.
size_t pooled_size(size_t size);
void* take_block(size_t bytes);
void give_back(void* block, size_t bytes);
// Free every kept block (a server gone idle gives its memory back); returns the bytes freed.
int64_t release_results();

// ---- norms and activation quantization (norm_quant.cpp) ------------------------------------------------------------
// RMSNorm of the rows of x [M, K] into y (y may be x), the row operations of the W8A8 linears: one row of rms_norm,
// and quantize_tokens on each group of G values (G % 16 == 0) of x [M, K] -> q [M, K], scale [M, K / G].
void rms_norm_rows(const float* x, const float* weight, int64_t M, int64_t K, double eps, float* y);
void norm_row(const float* x, const float* weight, int64_t K, double eps, float* y);
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int8_t* q, float* scale);

// ---- W8A8 linears (w8a8_linear.cpp) --------------------------------------------------------------------------------
// How an int8 weight is laid out (int8_panel_avx512.cpp): plain [N, K] int8, or packed in panels of 16 channels x 4 inputs,
// [N/16][K/4][16][4] with w_scale [N/16][K/G][16], as unsigned bytes w + 128 (the dpbusd path) or as signed bytes w
// (maddubs).
enum class Int8Panels { None, Unsigned, Signed };

// One int8 weight of a call: its int32 sums and, for a whole linear, the rescaled float32 output.
// Per channel (G = 0): acc [M, N], y = acc * x_scale[m] * w_scale[n] (+ bias[n]); y nullptr: int32 only.
// Per group of G inputs: no acc; y = sum_g x_scale[m, g] * w_scale[n, g] * dot_g (+ bias[n]).
struct Int8Job {
  const int8_t* w;
  int64_t N;
  int32_t* acc;  // [M, N]
  float* y = nullptr;  // [M, N]
  const float* w_scale = nullptr;
  const float* bias = nullptr;
  int64_t G = 0;
  Int8Panels panels = Int8Panels::None;
};

// All jobs of one quantized input q [M, K] (x_scale [M, K / G], or [M] per row) in one parallel region over all their
// output channels; each thread rescales the channels it summed.
void run_int8_jobs(Int8Path path, const int8_t* q, const float* x_scale, const std::vector<Int8Job>& jobs, int64_t M,
                   int64_t K);

// ---- GGUF-block linears (block_linear.cpp; W4A8 and W6A8) ----------------------------------------------------------
using BlockPanels = void (*)(Int8Path, const BlockCall&, int64_t, int64_t);
// x [M, K] float32 (K % 32 == 0) -> q [M, K] int8 per 32 inputs, x_scale [M, K/32], their sums xsum [M, K/32] and
// xsum16 [M, K/16].
void quantize_block_input(const float* x, int64_t M, int64_t K, int8_t* q, float* x_scale, int32_t* xsum,
                          int32_t* xsum16);
// Every output panel of every call in one parallel region, then each call's bias [N] (nullptr: none).
void run_block_calls(Int8Path path, const std::vector<BlockCall>& calls, const std::vector<BlockPanels>& kernels,
                     const std::vector<const float*>& bias);

// ---- float-activation linears (float_dot.cpp) ----------------------------------------------------------------------
enum class WeightType { Float32, BFloat16, Int8 };
// y [M, N] = (x [M, K] . w [N, K]^T) * scale[n] + bias[n] (scale, bias may be nullptr), float32 sums in a fixed order.
void float_act_dot(const float* x, const void* w, WeightType type, const float* scale, const float* bias, float* y,
                   int64_t M, int64_t N, int64_t K);
// Whether the bf16 products of the current path take an input rounded to bfloat16 as float32 numbers (true) or as
// bfloat16 bits (bf16_input_dtype).
bool bf16_rounded_as_float(int64_t K);
// count floats rounded to bfloat16 into out: float32 numbers (as_float) or bfloat16 bits.
void round_bf16_to(const float* x, int64_t count, void* out, bool as_float);
// x [M, K] times weights packed in panels of 16 channels (N = 16 panels): bfloat16 pairs [N/16, K/2, 16, 2] (pairs;
// x rounded as bf16_rounded_as_float says), float32 [N/16, K, 16] or bfloat16 [N/16, K, 16] (widened; x float32),
// plus bias [N] (or nullptr) -> y [M, N] float32.
void packed_dot(const void* x, const void* w, bool pairs, bool bf16, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K);

// ---- logits (logits.cpp) -------------------------------------------------------------------------------------------
// logits [R, V] -> out [R]: torch.argmax(logits, -1), the first index of the largest value (or of the first NaN).
void argmax_into(const float* logits, int64_t R, int64_t V, int64_t* out);
// out [R, V] = exp((logits - max) * inv_t) row by row; the rows' float64 sums.
std::vector<double> sampling_weights_into(const float* logits, float* out, int64_t R, int64_t V, double inv_t);
// weights = 0 where logits < keep_from[r]; the rows' new sums.
std::vector<double> keep_weights_into(const float* logits, float* weights, const float* keep_from, int64_t R,
                                      int64_t V);
// out [R] = the lowest logit top-k, then top-p keep in each row (-inf: neither filter on).
void filter_cuts_into(const float* logits, const float* weights, int64_t R, int64_t V, int64_t top_k, double top_p,
                      float* out);
// The index where the running float64 sum of weights [V] passes u * total (-1: every weight 0).
int64_t draw_index_at(const float* weights, int64_t V, double u);

// ---- attention (attention.cpp) -------------------------------------------------------------------------------------
// window: a sliding-window layer's (each query sees its last `window` positions), 0 for causal attention over the
// whole cache; scale: the scores' (0: head_dim^-1/2).
struct AttentionWindow {
  int64_t window = 0;
  double scale = 0;
};
// A sequence's keys and values, float32 [L, H_kv, S, D] each (k nullptr: none).
struct CacheView {
  float* k = nullptr;
  float* v = nullptr;
  int64_t H_kv = 0, S = 0, D = 0;
};
// One sequence's rows inside a call over several: its cache, positions filled, row count, and where its
// sliding-window layers keep their keys in rings [L_sliding, H_kv, 2 R, D] (R % 32 == 0), the cache then holding the
// other layers only (none: every layer in the cache).
// A draft tree's rows (`parents`, nullptr for a chain) are the parent row of each of the segment's rows: -1 for row 0,
// an earlier row for the others. A row at depth d (its ancestors: d) takes position start + d and its keys go to slot
// start + its row, it attends to the keys before start and to its ancestors' and its own (a plain cache only).
struct Segment {
  CacheView cache;
  int64_t start, rows;
  CacheView ring = {};
  const int64_t* parents = nullptr;
};
// The depth of each of a draft tree's rows from their parents (Segment::parents; checked: -1 for row 0, an earlier
// row for the others).
std::vector<int64_t> tree_depths(const int64_t* parents, int64_t rows);

// Rope, cache writes and attention of one step's rows over their sequences' caches, in parts any thread may run:
// rope(t0, t1) for every row first, then attend(i) for each work item i < items(), in any order and on any thread
// (the results never depend on which runs what). Built once per step, for every layer.
class AttentionSteps {
 public:
  // T rows of H query heads over the segments' caches; threads: how many share the items; bf16_products: the step's
  // linears take bfloat16 inputs (the bf16 verifier: then attention too runs on bfloat16 products where
  // bf16_attention says so, attention_amx.cpp); ring: the layer reads the segments' rings (a sliding-window layer's).
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
    // a draft tree's: each row's depth, and the slots (from the origin) of its path, root first, at paths[path_at[r]]
    std::vector<int64_t> depth, path_at, paths;
    int64_t position(int64_t row) const { return start + (depth.empty() ? row : depth[row]); }
  };
  // A tree segment's depths and paths into view (checked: each parent an earlier row, row 0 the root).
  static void plant(View& view, const int64_t* parents);
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

// The steps' rope and attention of layer `layer` over the T rows of q [T, H*D], k and v [T, H_kv*D], cos and sin
// [T, D], split between the threads: q_rot [T, H*D] is scratch, out [T, H*D] the result.
void attend_steps(const AttentionSteps& steps, int64_t layer, const float* q, const float* k, const float* v,
                  const float* cos, const float* sin, float* q_rot, float* out, int64_t T);
