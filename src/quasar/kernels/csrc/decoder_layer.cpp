// One whole decoder layer in one call: the same kernels the Python layer calls one by one (RMSNorm, linears,
// attention) plus ATen's silu, multiply and add, without the ~40 Python-level operations per layer in
// between. FusedLayers runs all layers of a model in one call, with their tensors handed over once instead
// of at every step.
//
// The rows of a call may belong to several sequences (segments), each with its own KV cache: the linears
// and norms run over all rows at once (each row's result depends on its own input alone), attention runs
// per segment over that segment's cache. So a request's rows get bitwise the same values whether they come
// alone, as a prefill chunk, or inside a batch with other requests' rows (continuous batching).
//
// x [T, hidden] float32. t holds, in order: input norm weight, post-attention norm weight, q-norm and
// k-norm weights (empty without qk-norm), then weight, scale and bias for q, k, v, o, gate, up, down
// (scale or bias empty where absent). kinds[i] says how linear i runs: 0 = W8A8 (int8 weight, per-token
// int8 activations), 1 = float32 activations (float32 weight, int8 weight with per-channel scale, or bfloat16
// weight), 2 = bfloat16 activations and packed bfloat16 weight (bf16_linear), 3 = packed float32 weight
// (float32, or bfloat16 widened: fp32_linear).
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace {

torch::Tensor linear(int64_t kind, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale,
                     const torch::Tensor& bias) {
  if (kind == 0) return w8a8_linear(x, w, scale, bias);
  if (kind == 1) return float_act_linear(x, w, scale, bias);
  return kind == 2 ? bf16_linear(x, w, bias) : fp32_linear(x, w, bias);
}

// Linear i of a layer's tensors t.
torch::Tensor linear(int64_t kind, const torch::Tensor& x, const std::vector<torch::Tensor>& t, int i) {
  return linear(kind, x, t[4 + 3 * i], t[5 + 3 * i], t[6 + 3 * i]);
}

bool all_of_kind(const std::vector<int64_t>& kinds, const std::vector<int>& which, int64_t kind) {
  return std::all_of(which.begin(), which.end(), [&](int i) { return kinds[i] == kind; });
}

// Linears `which` of the same input; W8A8 ones share one activation quantization, bf16 ones one rounding.
std::vector<torch::Tensor> linears(const torch::Tensor& x, const std::vector<torch::Tensor>& t,
                                   const std::vector<int64_t>& kinds, std::vector<int> which) {
  std::vector<torch::Tensor> out;
  if (all_of_kind(kinds, which, 2)) {
    const auto rounded = bf16_input(x);
    for (int i : which) out.push_back(bf16_linear_rounded(rounded, t[4 + 3 * i], t[6 + 3 * i]));
    return out;
  }
  if (!all_of_kind(kinds, which, 0)) {
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

// The MLP's silu(gate) * up, as ATen's silu_ and mul_ compute it, rounded for a bf16 down projection: in pieces of
// rows that stay in L2, one pass over the hidden units instead of three (a 1.5B prefill's are 37 MB a tensor).
// ATen's loops take 32 values a step and the rest one by one (another exp): pieces of whole rows of a multiple of
// 32 values are stepped as the whole tensor is, so each value is the unfused one (the caller checks I % 32 == 0).
torch::Tensor silu_mul_rounded(torch::Tensor gate, torch::Tensor up) {
  gate = gate.contiguous();
  up = up.contiguous();
  const int64_t M = gate.size(0), I = gate.size(1), rows = std::max<int64_t>(1, (64 << 10) / I);
  auto out = kernel_result({M, I}, torch::dtype(bf16_input_dtype(I)));
  float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  at::parallel_for(0, M, rows, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m += rows) {
      const int64_t n = std::min(rows, m1 - m);
      // views made on this thread: tensors of the caller's inference mode may not change in place outside it
      auto piece = at::from_blob(g + m * I, {n, I}, torch::dtype(torch::kFloat32));
      torch::silu_(piece).mul_(at::from_blob(u + m * I, {n, I}, torch::dtype(torch::kFloat32)));
      round_bf16_into(g + m * I, n * I, out, m * I);
    }
  });
  return out;
}

}  // namespace

torch::Tensor decoder_layer(torch::Tensor x, const std::vector<torch::Tensor>& t, const std::vector<int64_t>& kinds,
                            double eps, const torch::Tensor& cos, const torch::Tensor& sin,
                            const std::vector<Segment>& segments, int64_t layer) {
  TORCH_CHECK(t.size() == 4 + 3 * 7 && kinds.size() == 7, "4 norm tensors, then 7 x (weight, scale, bias)");
  const int64_t T = x.size(0), D = segments[0].cache_k.size(3);
  auto qkv = linears(rms_norm(x, t[0], eps), t, kinds, {0, 1, 2});
  auto q = qkv[0], k = qkv[1];
  if (t[2].numel()) {  // qk-norm (qwen3): per head, before rope
    q = rms_norm(q.view({-1, D}), t[2], eps).view({T, -1});
    k = rms_norm(k.view({-1, D}), t[3], eps).view({T, -1});
  }
  auto attended = segment_attention(q, k, qkv[2], cos, sin, segments, layer, all_of_kind(kinds, {0, 1, 2, 3, 4, 5, 6}, 2));
  // In place on the fresh results (a + b == b + a bit for bit): no new tensors between the kernels.
  x = linear(kinds[3], attended, t, 3).add_(x);
  auto gate_up = linears(rms_norm(x, t[1], eps), t, kinds, {4, 5});
  if (kinds[6] == 2 && gate_up[0].size(1) % 32 == 0)
    return bf16_linear_rounded(silu_mul_rounded(gate_up[0], gate_up[1]), t[4 + 3 * 6], t[6 + 3 * 6]).add_(x);
  return linear(kinds[6], torch::silu_(gate_up[0]).mul_(gate_up[1]), t, 6).add_(x);
}

FusedLayers::FusedLayers(std::vector<std::vector<torch::Tensor>> tensors, std::vector<std::vector<int64_t>> kinds,
                         double eps, std::vector<torch::Tensor> head, int64_t head_kind)
    : tensors_(std::move(tensors)), kinds_(std::move(kinds)), eps_(eps), head_(std::move(head)), head_kind_(head_kind) {
  TORCH_CHECK(tensors_.size() == kinds_.size(), "one kinds list per layer");
  TORCH_CHECK(head_.empty() || (head_.size() == 4 && head_kind_ >= 0 && head_kind_ <= 3),
              "the head is the final norm's weight, then the lm_head's weight, scale and bias, with its kind");
  region_ = plan_region(tensors_, kinds_, head_, head_kind_);
}

std::vector<Segment> FusedLayers::segments(const std::vector<torch::Tensor>& caches_k,
                                           const std::vector<torch::Tensor>& caches_v, const std::vector<int64_t>& starts,
                                           const std::vector<int64_t>& rows, int64_t total) const {
  const size_t n = caches_k.size();
  TORCH_CHECK(n > 0 && caches_v.size() == n && starts.size() == n && rows.size() == n, "one cache, start and row count per segment");
  std::vector<Segment> out;
  int64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {  // checked once here, not in every layer's attention
    const auto &k = caches_k[i], &v = caches_v[i];
    TORCH_CHECK(k.dim() == 4 && k.size(0) == static_cast<int64_t>(tensors_.size()) && k.sizes() == v.sizes() &&
                k.size(1) == caches_k[0].size(1) && k.size(3) == caches_k[0].size(3),
                "caches [L, H_kv, S, D] of this model expected");
    TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 && k.is_contiguous() &&
                v.is_contiguous() && k.device().is_cpu() && v.device().is_cpu(), "contiguous float32 CPU caches expected");
    TORCH_CHECK(rows[i] > 0, "every segment has at least one row");
    out.push_back(Segment{caches_k[i], caches_v[i], starts[i], rows[i]});
    sum += rows[i];
  }
  TORCH_CHECK(sum == total, "the segments' rows are x's rows");
  return out;
}

bool FusedLayers::one_region(int64_t rows) const { return region_ && region_runs(*region_, rows); }

// x [N, hidden], cos and sin [N, D]: the rows of several sequences one after another, `rows[i]` of them for
// sequence i, whose cache is caches_k[i], caches_v[i] [L, H_kv, S, D] with `starts[i]` positions filled.
torch::Tensor FusedLayers::forward_segments(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                            std::vector<torch::Tensor> caches_k, std::vector<torch::Tensor> caches_v,
                                            std::vector<int64_t> starts, std::vector<int64_t> rows) const {
  const auto segs = segments(caches_k, caches_v, starts, rows, x.size(0));
  TORCH_CHECK(cos.size(0) == x.size(0) && sin.size(0) == x.size(0), "one rope row per row of x");
  if (one_region(x.size(0))) return run_region(*region_, x, cos, sin, segs, eps_, nullptr);
  for (size_t i = 0; i < tensors_.size(); ++i)
    x = decoder_layer(x, tensors_[i], kinds_[i], eps_, cos, sin, segs, static_cast<int64_t>(i));
  return x;
}

namespace {

// Rows ids of an embedding table, widened to float32 -> [N, D]: plain [V, D], or packed in panels of 16 rows as the
// kernels read a tied lm_head ([V/16, D, 16], or [V/16, D/2, 16, 2] for bfloat16 inputs); float32 or bfloat16.
torch::Tensor embed_rows(const torch::Tensor& table, const std::vector<int64_t>& ids) {
  TORCH_CHECK(table.is_contiguous() && table.device().is_cpu() && table.dim() >= 2 && table.dim() <= 4 &&
              (table.dtype() == torch::kFloat32 || table.dtype() == torch::kBFloat16), "an embedding table as the kernels keep it expected");
  const bool bf16 = table.dtype() == torch::kBFloat16, panels = table.dim() > 2;
  const int64_t V = panels ? table.size(0) * 16 : table.size(0), D = table.dim() == 4 ? table.size(1) * 2 : table.size(1);
  auto out = torch::empty({static_cast<int64_t>(ids.size()), D}, table.options().dtype(torch::kFloat32));
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

// Rows starts[i] .. starts[i] + rows[i] - 1 of a rope table [L, D], segment after segment -> [N, D].
torch::Tensor rope_rows(const torch::Tensor& table, const std::vector<int64_t>& starts, const std::vector<int64_t>& rows) {
  TORCH_CHECK(table.dtype() == torch::kFloat32 && table.dim() == 2 && table.is_contiguous(), "a float32 rope table [L, D] expected");
  int64_t N = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    TORCH_CHECK(starts[i] >= 0 && starts[i] + rows[i] <= table.size(0), "the rope table ends before position ", starts[i] + rows[i] - 1);
    N += rows[i];
  }
  const int64_t D = table.size(1);
  auto out = torch::empty({N, D}, table.options());
  float* o = out.data_ptr<float>();
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(o, table.data_ptr<float>() + starts[i] * D, rows[i] * D * sizeof(float));
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
torch::Tensor FusedLayers::forward_tokens(std::vector<int64_t> ids, torch::Tensor embedding, torch::Tensor cos_table,
                                          torch::Tensor sin_table, std::vector<torch::Tensor> caches_k,
                                          std::vector<torch::Tensor> caches_v, std::vector<int64_t> starts,
                                          std::vector<int64_t> rows, std::vector<int64_t> picked) const {
  TORCH_CHECK(!head_.empty(), "these layers were built without the final norm and lm_head");
  TORCH_CHECK(starts.size() == rows.size(), "one start per segment");
  auto cos = rope_rows(cos_table, starts, rows), sin = rope_rows(sin_table, starts, rows);
  const int64_t N = cos.size(0);
  for (int64_t row : picked) TORCH_CHECK(row >= 0 && row < N, "picked row ", row, " is not one of the ", N, " rows");
  if (one_region(N) && region_has_head(*region_))  // the layers and the head in one region
    return run_region(*region_, embed_rows(embedding, ids), cos, sin, segments(caches_k, caches_v, starts, rows, N),
                      eps_, &picked);
  auto hidden = forward_segments(embed_rows(embedding, ids), cos, sin, std::move(caches_k), std::move(caches_v),
                                 std::move(starts), std::move(rows));
  const bool all = static_cast<int64_t>(picked.size()) == N && std::is_sorted(picked.begin(), picked.end());
  if (!all) hidden = hidden.index_select(0, torch::tensor(picked, torch::kInt64));
  return linear(head_kind_, rms_norm(hidden, head_[0], eps_), head_[1], head_[2], head_[3]);
}
