// Small steps (decode, verify, a few sequences' rows) of a model whose linears are all packed W8A8, every layer in
// one OpenMP parallel region.
//
// A one-row step streams the whole model's weights in a few hundred linears and attentions. Called one by one (decoder_layer.cpp), each opens its own parallel region, and between them one thread alone allocates
// the next tensors, normalizes, quantizes and runs ATen's silu, multiply and add while the others wait: a large
// share of the worker threads' time. Here the threads stay together for the whole step: each normalizes and
// quantizes a linear's few input rows itself (the same bytes on every thread), sums its share of the output
// channels, and they meet at a barrier only where a result needs every thread's channels (6 per layer). The
// arithmetic is the kernels' own (norm_row, quantize_rows, packed_panel_range, AttentionSteps, ATen's silu), each
// value computed by the same operations in the same order, so the logits are bitwise those of decoder_layer.cpp.
#include "int8_dot.h"
#include "kernels.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/silu.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <optional>

// One packed W8A8 linear (int8_panel_avx512.cpp): w [N/16, K/4, 16, 4] int8 (maddubs) or uint8 w + 128 (dpbusd),
// w_scale [N/16, K/G, 16], bias [N] or none.
struct PackedLinear {
  const void* w;
  const float* w_scale;
  const float* bias;
  int64_t N, K, G;
  bool unsigned_bytes;
};

struct RegionLayer {
  const float *norm_in, *norm_post, *q_norm, *k_norm;  // q_norm, k_norm: nullptr without qk-norm
  PackedLinear q, k, v, o, gate, up, down;
};

// The layers (and the head, where it is packed W8A8 too) as the region reads them; the tensors stay FusedLayers'.
struct RegionPlan {
  std::vector<RegionLayer> layers;
  std::optional<PackedLinear> head;
  const float* final_norm = nullptr;
  int64_t hidden = 0, I = 0, qk_norm_dim = 0;  // qk_norm_dim: the q/k-norm weights' size (the head dim), or 0
  bool unsigned_bytes = false;
};

namespace {

std::optional<PackedLinear> packed(const LinearWeights& linear) {
  if (linear.kind != LinearKind::W8A8) return std::nullopt;
  const at::Tensor &w = linear.weight, &scale = linear.scale, &bias = linear.bias;
  const bool bytes = w.dtype() == at::kChar || w.dtype() == at::kByte;
  if (w.dim() != 4 || !bytes || !w.is_contiguous() || !w.device().is_cpu() || w.size(2) != 16 || w.size(3) != 4 ||
      scale.dim() != 3 || scale.dtype() != at::kFloat || !scale.is_contiguous() || scale.size(2) != 16)
    return std::nullopt;
  const int64_t N = w.size(0) * 16, K = w.size(1) * 4, G = K / scale.size(1);
  if (G * scale.size(1) != K || G % 32 || scale.size(0) * 16 != N) return std::nullopt;
  if (bias.numel() && (bias.dtype() != at::kFloat || !bias.is_contiguous() || bias.numel() != N)) return std::nullopt;
  return PackedLinear{w.data_ptr(), scale.data_ptr<float>(), bias.numel() ? bias.data_ptr<float>() : nullptr, N, K, G,
                      w.dtype() == at::kByte};
}

// A float32 CPU vector of n values, as the region reads it.
bool float_vector(const at::Tensor& t, int64_t n) {
  return t.dtype() == at::kFloat && t.is_contiguous() && t.device().is_cpu() && t.numel() == n;
}

// A linear's input rows, quantized by one thread for itself: q [M, K], scale [M, K/G], start [M, K/G] (dpbusd).
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<int32_t> start;
};

// Rows [0, M) of x [M, K] (normalized by norm first, if given) quantized in groups of G into in.
void quantize_input(const float* x, int64_t M, int64_t K, const float* norm, double eps, int64_t G, bool starts,
                    std::vector<float>& normed, Quantized& in) {
  in.q.resize(M * K);
  in.scale.resize(M * K / G);
  if (norm) {
    normed.resize(M * K);
    for (int64_t m = 0; m < M; ++m) norm_row(x + m * K, norm, K, eps, normed.data() + m * K);
    x = normed.data();
  }
  quantize_rows(x, M, K, G, in.q.data(), in.scale.data());
  if (starts) {
    in.start.resize(M * K / G);
    group_starts(in.q.data(), M, K, G, in.start.data());
  }
}

// Channels [n0, n1) (whole panels, or up to N) of y [M, N] = the linear of the quantized rows, bias added.
void linear_range(const PackedLinear& L, const int8_t* q, const int32_t* start, const float* x_scale, float* y,
                  int64_t M, int64_t n0, int64_t n1) {
  packed_panel_range(L.w, L.unsigned_bytes, L.w_scale, L.bias, q, start, x_scale, y, M, L.N, L.K, L.G, n0, n1);
}

// Part `tid` of `parts` of [0, units).
std::pair<int64_t, int64_t> share(int64_t units, int tid, int parts) {
  return {units * tid / parts, units * (tid + 1) / parts};
}

// This thread's share of the panels of several linears of one input (q, k, v): all their panels split evenly.
void linears_share(const std::vector<const PackedLinear*>& linears, const Quantized& in, const std::vector<float*>& ys,
                   int64_t M, int tid, int parts) {
  int64_t panels = 0;
  for (const PackedLinear* L : linears) panels += L->N / 16;
  const auto [p0, p1] = share(panels, tid, parts);
  int64_t first = 0;
  for (size_t i = 0; i < linears.size(); ++i) {
    const int64_t own = linears[i]->N / 16, a = std::max(p0, first) - first, b = std::min(p1, first + own) - first;
    linear_range(*linears[i], in.q.data(), in.start.data(), in.scale.data(), ys[i], M, 16 * a, 16 * b);
    first += own;
  }
}

// x [M, N] += y [M, N] on channels [n0, n1) (x = y + x, as decoder_layer's add_: the same float).
void add_range(const float* y, float* x, int64_t M, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = n0; n < n1; ++n) x[m * N + n] = y[m * N + n] + x[m * N + n];
}

}  // namespace

std::shared_ptr<const RegionPlan> plan_region(const std::vector<LayerWeights>& layers,
                                              const std::optional<HeadWeights>& head) {
  auto plan = std::make_shared<RegionPlan>();
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerWeights& w = layers[l];
    if (!w.llama_form()) return nullptr;  // the region runs the Llama family's layers only
    std::vector<PackedLinear> lin;
    for (const LinearWeights* linear : w.linears()) {
      auto p = packed(*linear);
      if (!p || ((!plan->layers.empty() || !lin.empty()) && p->unsigned_bytes != plan->unsigned_bytes)) return nullptr;
      plan->unsigned_bytes = p->unsigned_bytes;
      lin.push_back(*p);
    }
    const auto &q = lin[0], &k = lin[1], &v = lin[2], &o = lin[3], &gate = lin[4], &up = lin[5], &down = lin[6];
    const int64_t hidden = q.K;
    const bool shapes = k.K == hidden && v.K == hidden && q.G == k.G && q.G == v.G && o.N == hidden && o.K == q.N &&
                        gate.K == hidden && up.K == hidden && gate.N == up.N && gate.G == up.G && down.K == gate.N &&
                        down.N == hidden && k.N == v.N && gate.N % down.G == 0;
    const auto& before = plan->layers.empty() ? down : plan->layers[0].down;  // one group size for down's input
    if (!shapes || down.G != before.G || (l && (hidden != plan->hidden || gate.N != plan->I))) return nullptr;
    const int64_t qk = w.q_norm.numel();  // qk-norm: one weight of the head dim for q, one for k
    if (!float_vector(w.input_norm, hidden) || !float_vector(w.post_attention_norm, hidden) ||
        !float_vector(w.k_norm, qk) || (qk && (!float_vector(w.q_norm, qk) || q.N % qk || k.N % qk)) ||
        (l && qk != plan->qk_norm_dim))
      return nullptr;
    plan->qk_norm_dim = qk;
    plan->hidden = hidden;
    plan->I = gate.N;
    plan->layers.push_back(RegionLayer{w.input_norm.data_ptr<float>(), w.post_attention_norm.data_ptr<float>(),
                                       qk ? w.q_norm.data_ptr<float>() : nullptr,
                                       w.k_norm.numel() ? w.k_norm.data_ptr<float>() : nullptr, q, k, v, o, gate, up,
                                       down});
  }
  if (plan->layers.empty()) return nullptr;
  if (head) {
    auto p = packed(head->lm_head);
    if (p && p->unsigned_bytes == plan->unsigned_bytes && p->K == plan->hidden && float_vector(head->norm, plan->hidden)) {
      plan->head = p;
      plan->final_norm = head->norm.data_ptr<float>();
    }
  }
  return plan;
}

// Steps of up to this many rows: each thread quantizes every row of a linear's input for itself, a small cost
// beside the weights' stream at a decode or verify step, not at a prefill's hundreds of rows.
constexpr int64_t kRegionRows = 32;

bool region_runs(const RegionPlan& plan, int64_t rows) {
  return rows <= kRegionRows && (!plan.unsigned_bytes || linear_path() == Int8Path::Dpbusd);
}

bool region_has_head(const RegionPlan& plan) { return plan.head.has_value(); }

// The rows of the segments through every layer (x [T, hidden], cos and sin [T, D], checked by the caller), then,
// with `picked` and a packed head, the final norm and the lm_head on those rows: logits [picked, V], else the
// hidden states [T, hidden].
at::Tensor run_region(const RegionPlan& plan, at::Tensor x, const at::Tensor& cos, const at::Tensor& sin,
                         const std::vector<Segment>& segments, double eps, const std::vector<int64_t>* picked) {
  for (const auto& t : {x, cos, sin})
    TORCH_CHECK(t.dtype() == at::kFloat && t.dim() == 2 && t.device().is_cpu(), "float32 CPU x, cos and sin expected");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "contiguous rope rows expected");
  const int64_t M = x.size(0), hidden = plan.hidden, I = plan.I;
  const RegionLayer& first = plan.layers[0];
  const int64_t D = segments[0].cache.D, H = first.q.N / D, H_kv = first.k.N / D;
  TORCH_CHECK(H * D == first.q.N && H_kv * D == first.k.N && x.size(1) == hidden &&
              (plan.qk_norm_dim == 0 || plan.qk_norm_dim == D), "bad head shapes");
  const int threads = at::get_num_threads();
  const AttentionSteps steps(segments, M, H, threads);
  x = x.contiguous().clone();  // the residual stream, updated in place
  auto f32 = x.options();
  auto yq = at::empty({M, first.q.N}, f32), yk = at::empty({M, first.k.N}, f32), yv = at::empty({M, first.v.N}, f32);
  auto q_rot = at::empty_like(yq), attended = at::empty_like(yq), y_out = at::empty({M, hidden}, f32);
  auto gate = at::empty({M, I}, f32), up = at::empty({M, I}, f32);
  const int64_t G_down = first.down.G;
  auto act_q = at::empty({M, I}, x.options().dtype(at::kChar)), act_scale = at::empty({M, I / G_down}, f32);
  auto act_start = at::empty({plan.unsigned_bytes ? M : 0, I / G_down}, x.options().dtype(at::kInt));
  const bool head = picked && plan.head;
  const int64_t P = head ? static_cast<int64_t>(picked->size()) : 0;
  auto logits = at::empty({P, head ? plan.head->N : 0}, f32);
  float *xp = x.data_ptr<float>(), *qp = yq.data_ptr<float>(), *kp = yk.data_ptr<float>(), *vp = yv.data_ptr<float>();
  float *qr = q_rot.data_ptr<float>(), *att = attended.data_ptr<float>(), *yo = y_out.data_ptr<float>();
  float *gp = gate.data_ptr<float>(), *up_p = up.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  int8_t* aq = act_q.data_ptr<int8_t>();
  float* as = act_scale.data_ptr<float>();
  int32_t* ast = plan.unsigned_bytes ? act_start.data_ptr<int32_t>() : nullptr;
  std::atomic<int64_t> next{0};
  const int64_t n_items = steps.items();

#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num(), parts = omp_get_num_threads();
    Quantized in;
    std::vector<float> normed, scores;
    const auto [t0, t1] = share(M, tid, parts);
    const auto [h0, h1] = share(hidden / 16, tid, parts);  // this thread's panels of o, down
    const auto [u0, u1] = share(I / G_down, tid, parts);   // and its groups of gate, up (down's input groups)
    const int64_t c0 = 16 * h0, c1 = std::min(16 * h1, hidden), i0 = u0 * G_down, i1 = u1 * G_down;
    for (size_t l = 0; l < plan.layers.size(); ++l) {
      const RegionLayer& L = plan.layers[l];
      quantize_input(xp, M, hidden, L.norm_in, eps, L.q.G, plan.unsigned_bytes, normed, in);
      linears_share({&L.q, &L.k, &L.v}, in, {qp, kp, vp}, M, tid, parts);
#pragma omp barrier
      for (int64_t t = t0; t < t1; ++t) {
        if (L.q_norm)  // qk-norm (qwen3): per head, before rope
          for (int64_t h = 0; h < H; ++h) norm_row(qp + (t * H + h) * D, L.q_norm, D, eps, qp + (t * H + h) * D);
        if (L.k_norm)
          for (int64_t h = 0; h < H_kv; ++h) norm_row(kp + (t * H_kv + h) * D, L.k_norm, D, eps, kp + (t * H_kv + h) * D);
      }
      steps.rope(static_cast<int64_t>(l), qp, kp, vp, cp, sp, qr, t0, t1);
      if (tid == 0) next.store(0);
#pragma omp barrier
      for (int64_t i = next++; i < n_items; i = next++) steps.attend(static_cast<int64_t>(l), i, qr, att, scores);
#pragma omp barrier
      quantize_input(att, M, L.o.K, nullptr, eps, L.o.G, plan.unsigned_bytes, normed, in);
      linear_range(L.o, in.q.data(), in.start.data(), in.scale.data(), yo, M, c0, c1);
      add_range(yo, xp, M, hidden, c0, c1);
#pragma omp barrier
      quantize_input(xp, M, hidden, L.norm_post, eps, L.gate.G, plan.unsigned_bytes, normed, in);
      linear_range(L.gate, in.q.data(), in.start.data(), in.scale.data(), gp, M, i0, i1);
      linear_range(L.up, in.q.data(), in.start.data(), in.scale.data(), up_p, M, i0, i1);
      if (i1 > i0) {
        // ATen's silu on this thread's channels (its vectorised loop: the floats decoder_layer gets), times up;
        // then down's input groups that lie in them.
        auto slice = at::from_blob(gp + i0, {M, i1 - i0}, {I, 1}, f32);
        at::silu_(slice);
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t n = i0; n < i1; ++n) gp[m * I + n] = gp[m * I + n] * up_p[m * I + n];
          quantize_rows(gp + m * I + i0, 1, i1 - i0, G_down, aq + m * I + i0, as + (m * I + i0) / G_down);
          if (ast) group_starts(aq + m * I + i0, 1, i1 - i0, G_down, ast + (m * I + i0) / G_down);
        }
      }
#pragma omp barrier
      linear_range(L.down, aq, ast, as, yo, M, c0, c1);
      add_range(yo, xp, M, hidden, c0, c1);
#pragma omp barrier
    }
    if (head) {
      const PackedLinear& lm = *plan.head;
      std::vector<float> rows(P * hidden);
      for (int64_t r = 0; r < P; ++r) std::copy(xp + (*picked)[r] * hidden, xp + ((*picked)[r] + 1) * hidden, rows.data() + r * hidden);
      quantize_input(rows.data(), P, hidden, plan.final_norm, eps, lm.G, plan.unsigned_bytes, normed, in);
      const auto [v0, v1] = share(lm.N / 16, tid, parts);
      linear_range(lm, in.q.data(), in.start.data(), in.scale.data(), logits.data_ptr<float>(), P, 16 * v0,
                   std::min(16 * v1, lm.N));
    }
  }
  return head ? logits : x;
}
