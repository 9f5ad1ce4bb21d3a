// One whole decoder layer in one call: the same kernels the Python layer calls one by one (RMSNorm, linears,
// attention) plus ATen's silu (or Gemma's tanh gelu), multiply and add, without the ~40 Python-level operations per layer in
// between. FusedLayers runs all layers of a model in one call, with their tensors handed over once instead
// of at every step.
//
// The rows of a call may belong to several sequences (segments), each with its own KV cache: the linears
// and norms run over all rows at once (each row's result depends on its own input alone), attention runs
// per segment over that segment's cache. So a request's rows get bitwise the same values whether they come
// alone, as a prefill chunk, or inside a batch with other requests' rows (continuous batching).
//
// x [T, hidden] float32; a layer's weights come by name (LayerWeights, linear_kind.h), each linear with the kind
// that picks its kernel from kLinears.
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/tensor.h>

#include <algorithm>
#include <cstring>

namespace {

using LinearFn = at::Tensor (*)(const at::Tensor& x, const LinearWeights& w);

// The kernel of each linear kind, in LinearKind's order.
constexpr LinearFn kLinears[kLinearKinds] = {
    [](const at::Tensor& x, const LinearWeights& w) { return w8a8_linear(x, w.weight, w.scale, w.bias); },
    [](const at::Tensor& x, const LinearWeights& w) { return float_act_linear(x, w.weight, w.scale, w.bias); },
    [](const at::Tensor& x, const LinearWeights& w) { return bf16_linear(x, w.weight, w.bias); },
    [](const at::Tensor& x, const LinearWeights& w) { return fp32_linear(x, w.weight, w.bias); },
    [](const at::Tensor& x, const LinearWeights& w) { return block_linear(x, w.weight, w.scale, w.bias); },
    [](const at::Tensor& x, const LinearWeights& w) { return block_linear(x, w.weight, w.scale, w.bias); },
    [](const at::Tensor& x, const LinearWeights& w) { return w8a8_residual_linear(x, w.weight, w.scale, w.bias); },
};

at::Tensor linear(const at::Tensor& x, const LinearWeights& w) { return kLinears[static_cast<int>(w.kind)](x, w); }

bool all_of_kind(const std::vector<const LinearWeights*>& which, LinearKind kind) {
  return std::all_of(which.begin(), which.end(), [&](const LinearWeights* w) { return w->kind == kind; });
}

// Linears `which` of the same input; W8A8 ones share one activation quantization, GGUF-block ones (W4A8, W6A8)
// another, bf16 ones one rounding.
std::vector<at::Tensor> linears(const at::Tensor& x, const std::vector<const LinearWeights*>& which) {
  std::vector<at::Tensor> out;
  if (all_of_kind(which, LinearKind::BF16)) {
    const auto rounded = bf16_input(x);
    for (const LinearWeights* w : which) out.push_back(bf16_linear_rounded(rounded, w->weight, w->bias));
    return out;
  }
  const bool w8 = all_of_kind(which, LinearKind::W8A8);
  const bool blocks = std::all_of(which.begin(), which.end(), [](const LinearWeights* w) {
    return w->kind == LinearKind::W4A8 || w->kind == LinearKind::W6A8;
  });
  if (!w8 && !blocks) {
    for (const LinearWeights* w : which) out.push_back(linear(x, *w));
    return out;
  }
  std::vector<at::Tensor> weight, scale, bias;
  for (const LinearWeights* w : which) {
    weight.push_back(w->weight);
    scale.push_back(w->scale);
    bias.push_back(w->bias);
  }
  return w8 ? w8a8_linear_many(x, weight, scale, bias) : block_linear_many(x, weight, scale, bias);
}

// An absent tensor as the kernels take it: empty, never undefined.
void fill_absent(at::Tensor& t) {
  if (!t.defined()) t = at::empty({0});
}

void fill_absent(LinearWeights& w) {
  TORCH_CHECK(w.weight.defined(), "every linear needs its weight");
  fill_absent(w.scale);
  fill_absent(w.bias);
}

// act(gate) in place, as ATen's silu_ or gelu_(tanh) computes it.
at::Tensor& activate_(at::Tensor& gate, Activation act) {
  return act == Activation::SILU ? at::silu_(gate) : at::gelu_(gate, "tanh");
}

// ATen runs an elementwise op over at most this many values on one thread, in one vector loop (taking 32 values a step
// and the rest one by one, other floats than the vector's); over more, it splits them between threads by the tensor's
// size and the thread count (gelu's GELU_MIN_ELEMENTS_FOR_MULTI_THREADING), so a row's values would depend on how many
// rows came with it.
constexpr int64_t kSerialValues = 6144;

// The MLP's act(gate) * up, as ATen's silu_ (gelu_) and mul_ compute it, in place in gate; with `rounded`, then rounded
// into a bf16 down projection's input (returned; else gate). One pass over the hidden units instead of three (a 1.5B
// prefill's are 37 MB a tensor), in pieces of at most kSerialValues: whole rows of a multiple of 32 values where they
// fit, else the same column ranges of each row, so every value is the same whatever rows and threads come with it.
at::Tensor act_mul(at::Tensor gate, at::Tensor up, Activation act, bool rounded) {
  gate = gate.contiguous();
  up = up.contiguous();
  const int64_t M = gate.size(0), I = gate.size(1);
  const int64_t rows = I % 32 || I > kSerialValues ? 1 : kSerialValues / I, span = std::min(I, kSerialValues);
  auto out = rounded ? kernel_result({M, I}, at::dtype(bf16_input_dtype(I))) : gate;
  float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  at::parallel_for(0, M, rows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m += rows) {
      const int64_t n = std::min(rows, m1 - m);
      for (int64_t c = 0; c < I; c += span) {  // views made on this thread: tensors of the caller's inference mode
        const int64_t width = std::min(span, I - c);  // may not change in place outside it
        auto piece = at::from_blob(g + m * I + c, {n, width}, {I, 1}, at::dtype(at::kFloat));
        activate_(piece, act).mul_(at::from_blob(u + m * I + c, {n, width}, {I, 1}, at::dtype(at::kFloat)));
      }
      if (rounded) round_bf16_into(g + m * I, n * I, out, m * I);
    }
  });
  return out;
}

}  // namespace

at::Tensor decoder_layer(at::Tensor x, const LayerWeights& w, double eps, const StepRope& rope,
                            const std::vector<Segment>& segments, int64_t layer, bool ring) {
  const int64_t T = x.size(0), D = segments[0].cache.D;
  auto qkv = linears(rms_norm(x, w.input_norm, eps), {&w.q, &w.k, &w.v});
  auto q = qkv[0], k = qkv[1];
  if (w.q_norm.numel()) {  // qk-norm (qwen3, Gemma): per head, before rope
    q = rms_norm(q.view({-1, D}), w.q_norm, eps).view({T, -1});
    k = rms_norm(k.view({-1, D}), w.k_norm, eps).view({T, -1});
  }
  const auto all = w.linears();
  const bool bf16_products = all_of_kind({all.begin(), all.end()}, LinearKind::BF16);
  const auto &cos = w.local_rope ? rope.local_cos : rope.cos, &sin = w.local_rope ? rope.local_sin : rope.sin;
  auto attended = segment_attention(q, k, qkv[2], cos, sin, segments, layer, bf16_products,
                                    AttentionWindow{w.window, w.attention_scale}, ring);
  // In place on the fresh results (a + b == b + a bit for bit): no new tensors between the kernels.
  auto out = linear(attended, w.o);
  x = (w.attention_out_norm.numel() ? rms_norm(out, w.attention_out_norm, eps) : out).add_(x);
  auto gate_up = linears(rms_norm(x, w.post_attention_norm, eps), {&w.gate, &w.up});
  if (w.down.kind == LinearKind::BF16 && gate_up[0].size(1) % 32 == 0)
    out = bf16_linear_rounded(act_mul(gate_up[0], gate_up[1], w.activation, true), w.down.weight, w.down.bias);
  else
    out = linear(act_mul(gate_up[0], gate_up[1], w.activation, false), w.down);
  return (w.mlp_out_norm.numel() ? rms_norm(out, w.mlp_out_norm, eps) : out).add_(x);
}

FusedLayers::FusedLayers(std::vector<LayerWeights> layers, double eps, std::optional<HeadWeights> head)
    : layers_(std::move(layers)), eps_(eps), head_(std::move(head)) {
  for (LayerWeights& w : layers_) {
    TORCH_CHECK(w.input_norm.defined() && w.post_attention_norm.defined(), "every layer needs its two norms");
    TORCH_CHECK(w.window >= 0 && w.attention_scale >= 0, "a window of 0 (none) or more keys, a scale of 0 (D^-1/2) or more");
    for (at::Tensor* t : {&w.q_norm, &w.k_norm, &w.attention_out_norm, &w.mlp_out_norm}) fill_absent(*t);
    local_rope_ = local_rope_ || w.local_rope;
    index_.push_back(w.window ? rings_++ : plains_++);
    for (LinearWeights* l : {&w.q, &w.k, &w.v, &w.o, &w.gate, &w.up, &w.down}) fill_absent(*l);
  }
  if (head_) {
    TORCH_CHECK(head_->norm.defined(), "the head needs the final norm's weight");
    fill_absent(head_->lm_head);
  }
  region_ = plan_region(layers_, head_);
}

namespace {

// The view of a sequence's caches, of this model's shape (the first sequence's heads and head_dim); cache_view checks
// the rest.
CacheView check_cache(const at::Tensor& k, const at::Tensor& v, int64_t layers, const at::Tensor& like) {
  TORCH_CHECK(k.dim() == 4 && k.size(0) == layers && k.sizes() == v.sizes() && k.size(1) == like.size(1) &&
              k.size(3) == like.size(3), "caches [L, H_kv, S, D] of this model expected");
  return cache_view(k, v);
}

}  // namespace

std::vector<Segment> FusedLayers::segments(const std::vector<at::Tensor>& caches_k,
                                           const std::vector<at::Tensor>& caches_v, const std::vector<at::Tensor>& rings_k,
                                           const std::vector<at::Tensor>& rings_v, const std::vector<int64_t>& starts,
                                           const std::vector<int64_t>& rows, int64_t total,
                                           const std::vector<std::vector<int64_t>>& trees) const {
  const size_t n = caches_k.size();
  TORCH_CHECK(n > 0 && caches_v.size() == n && starts.size() == n && rows.size() == n, "one cache, start and row count per segment");
  TORCH_CHECK(trees.empty() || trees.size() == n, "no trees, or one (empty: a chain) per segment");
  const bool rings = !rings_k.empty();
  TORCH_CHECK(!rings || (rings_k.size() == n && rings_v.size() == n && rings_ > 0), "one ring per segment, for a model with windows");
  std::vector<Segment> out;
  int64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {  // checked once here, not in every layer's attention
    const CacheView cache = check_cache(caches_k[i], caches_v[i], rings ? plains_ : static_cast<int64_t>(layers_.size()),
                                        caches_k[0]);
    CacheView ring;
    if (rings) {
      ring = check_cache(rings_k[i], rings_v[i], rings_, caches_k[0]);
      TORCH_CHECK(rings_k[i].size(2) % 64 == 0, "a ring of 2 R slots, R a multiple of 32, expected");
    }
    TORCH_CHECK(rows[i] > 0, "every segment has at least one row");
    const bool tree = !trees.empty() && !trees[i].empty();
    TORCH_CHECK(!tree || static_cast<int64_t>(trees[i].size()) == rows[i], "a tree's parents are one per row");
    out.push_back(Segment{cache, starts[i], rows[i], ring, tree ? trees[i].data() : nullptr});
    sum += rows[i];
  }
  TORCH_CHECK(sum == total, "the segments' rows are x's rows");
  return out;
}

bool FusedLayers::one_region(int64_t rows) const { return region_ && region_runs(*region_, rows); }

StepRope FusedLayers::step_rope(const std::vector<at::Tensor>& rope, int64_t rows) const {
  TORCH_CHECK(rope.size() == 4 || (rope.size() == 2 && !local_rope_),
              "cos, sin, then the sliding-window layers' cos, sin expected");
  for (const auto& t : rope) TORCH_CHECK(t.dim() == 2 && t.size(0) == rows, "one rope row per row of x");
  return rope.size() == 4 ? StepRope{rope[0], rope[1], rope[2], rope[3]} : StepRope{rope[0], rope[1], {}, {}};
}

// x [N, hidden], rope as step_rope's: the rows of several sequences one after another, `rows[i]` of them for
// sequence i, whose cache is caches_k[i], caches_v[i] [L, H_kv, S, D] with `starts[i]` positions filled; with rings
// (rings_k[i], rings_v[i]), the sliding-window layers' keys are there and caches_k[i] holds the other layers'.
at::Tensor FusedLayers::forward_segments(at::Tensor x, std::vector<at::Tensor> rope,
                                            std::vector<at::Tensor> caches_k, std::vector<at::Tensor> caches_v,
                                            std::vector<at::Tensor> rings_k, std::vector<at::Tensor> rings_v,
                                            std::vector<int64_t> starts, std::vector<int64_t> rows,
                                            std::vector<std::vector<int64_t>> trees) const {
  const auto segs = segments(caches_k, caches_v, rings_k, rings_v, starts, rows, x.size(0), trees);
  const StepRope step = step_rope(rope, x.size(0));
  if (one_region(x.size(0))) return run_region(*region_, x, step.cos, step.sin, segs, eps_, nullptr);
  const bool rings = !rings_k.empty();
  for (size_t i = 0; i < layers_.size(); ++i) {
    const bool ring = rings && layers_[i].window;
    x = decoder_layer(x, layers_[i], eps_, step, segs, rings ? index_[i] : static_cast<int64_t>(i), ring);
  }
  return x;
}

namespace {

// Rows ids of an embedding table, widened to float32 -> [N, D]: plain [V, D], or packed in panels of 16 rows as the
// kernels read a tied lm_head ([V/16, D, 16], or [V/16, D/2, 16, 2] for bfloat16 inputs); float32 or bfloat16.
at::Tensor embed_rows(const at::Tensor& table, const std::vector<int64_t>& ids) {
  TORCH_CHECK(table.is_contiguous() && table.device().is_cpu() && table.dim() >= 2 && table.dim() <= 4 &&
              (table.dtype() == at::kFloat || table.dtype() == at::kBFloat16), "an embedding table as the kernels keep it expected");
  const bool bf16 = table.dtype() == at::kBFloat16, panels = table.dim() > 2;
  const int64_t V = panels ? table.size(0) * 16 : table.size(0), D = table.dim() == 4 ? table.size(1) * 2 : table.size(1);
  auto out = at::empty({static_cast<int64_t>(ids.size()), D}, table.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const float* f = bf16 ? nullptr : table.data_ptr<float>();
  const uint16_t* b = bf16 ? reinterpret_cast<const uint16_t*>(table.data_ptr()) : nullptr;
  for (size_t r = 0; r < ids.size(); ++r, o += D) {
    const int64_t id = ids[r];
    TORCH_CHECK(id >= 0 && id < V, "token id ", id, " is not in the vocabulary of ", V);
    for (int64_t d = 0; d < D; ++d) {
      // element (id, d) of the table in its layout: plain, or panel id / 16, lane id % 16
      const int64_t at = !panels ? id * D + d : table.dim() == 3 ? (id / 16 * D + d) * 16 + id % 16
                                                                 : ((id / 16 * (D / 2) + d / 2) * 16 + id % 16) * 2 + d % 2;
      if (bf16) {
        const uint32_t bits = static_cast<uint32_t>(b[at]) << 16;  // bfloat16 -> float32 is exact
        std::memcpy(o + d, &bits, 4);
      } else {
        o[d] = f[at];
      }
    }
  }
  return out;
}

// The rows of a rope table [L, D] at each segment's positions, segment after segment -> [N, D]: starts[i] ..
// starts[i] + rows[i] - 1, or for a draft tree (trees[i]: its parent rows) starts[i] + each row's depth.
at::Tensor rope_rows(const at::Tensor& table, const std::vector<int64_t>& starts, const std::vector<int64_t>& rows,
                     const std::vector<std::vector<int64_t>>& trees) {
  TORCH_CHECK(table.dtype() == at::kFloat && table.dim() == 2 && table.is_contiguous(), "a float32 rope table [L, D] expected");
  int64_t N = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && starts[i] + rows[i] <= table.size(0), "the rope table ends before position ", starts[i] + rows[i] - 1);
    N += rows[i];
  }
  const int64_t D = table.size(1);
  auto out = at::empty({N, D}, table.options());
  float* o = out.data_ptr<float>();
  for (size_t i = 0; i < rows.size(); ++i) {
    const bool tree = !trees.empty() && !trees[i].empty();
    TORCH_CHECK(!tree || static_cast<int64_t>(trees[i].size()) == rows[i], "a tree's parents are one per row");
    const std::vector<int64_t> depth = tree ? tree_depths(trees[i].data(), rows[i]) : std::vector<int64_t>{};
    for (int64_t r = 0; r < rows[i]; ++r)
      std::memcpy(o + r * D, table.data_ptr<float>() + (starts[i] + (tree ? depth[r] : r)) * D, D * sizeof(float));
    o += rows[i] * D;
  }
  return out;
}

}  // namespace

// A whole forward from token ids: the embedding rows, the rope rows of each segment's positions, every layer
// (forward_segments), then the final norm and the lm_head on the rows `picked` (a prefill's last row, every row
// of a verify step) -> float32 logits [picked, V], the values the model's own modules give one by one. After a
// forward has streamed the weights through the caches each Python-level operation costs tens of microseconds,
// and the embedding, the rope rows and the tail were about ten of them.
at::Tensor FusedLayers::forward_tokens(std::vector<int64_t> ids, at::Tensor embedding,
                                          std::vector<at::Tensor> rope_tables, std::vector<at::Tensor> caches_k,
                                          std::vector<at::Tensor> caches_v, std::vector<at::Tensor> rings_k,
                                          std::vector<at::Tensor> rings_v, std::vector<int64_t> starts,
                                          std::vector<int64_t> rows, std::vector<int64_t> picked,
                                          std::vector<std::vector<int64_t>> trees) const {
  TORCH_CHECK(head_.has_value(), "these layers were built without the final norm and lm_head");
  TORCH_CHECK(starts.size() == rows.size(), "one start per segment");
  std::vector<at::Tensor> rope;
  for (const auto& table : rope_tables) rope.push_back(rope_rows(table, starts, rows, trees));
  const auto &cos = rope.at(0), &sin = rope.at(1);
  const int64_t N = cos.size(0);
  for (int64_t row : picked) TORCH_CHECK(row >= 0 && row < N, "picked row ", row, " is not one of the ", N, " rows");
  if (one_region(N) && region_has_head(*region_))  // the layers and the head in one region
    return run_region(*region_, embed_rows(embedding, ids), cos, sin,
                      segments(caches_k, caches_v, rings_k, rings_v, starts, rows, N, trees), eps_, &picked);
  auto hidden = forward_segments(embed_rows(embedding, ids), std::move(rope), std::move(caches_k), std::move(caches_v),
                                 std::move(rings_k), std::move(rings_v), std::move(starts), std::move(rows),
                                 std::move(trees));
  const bool all = static_cast<int64_t>(picked.size()) == N && std::is_sorted(picked.begin(), picked.end());
  if (!all) hidden = hidden.index_select(0, at::tensor(picked, at::kLong));
  return linear(rms_norm(hidden, head_->norm, eps_), head_->lm_head);
}
