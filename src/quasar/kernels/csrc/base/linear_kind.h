// The weights of a decoder layer as the fused kernels take them (FusedLayers, decoder_layer.cpp,
// packed_w8a8_step.cpp), by name, and how each linear runs.
#pragma once
#include "aten.h"

#include <array>
#include <cstdint>

// How a linear runs: one entry each in decoder_layer.cpp's dispatch table. Python's
// quasar.kernels.layers.LinearKind has the same names and values (bindings.cpp exports this one; the Python side
// checks them against each other when it first takes the kernels).
enum class LinearKind : int64_t {
  W8A8 = 0,               // int8 weight, per-token int8 activations (w8a8_linear)
  FLOAT_ACTIVATIONS = 1,  // float32 activations times a plain float32, int8 (per-channel scale) or bfloat16 weight
                          // (float_act_linear)
  BF16 = 2,               // bfloat16 activations times a packed bfloat16 weight (bf16_linear)
  PACKED_FP32 = 3,        // float32 activations times a packed float32 or widened bfloat16 weight (fp32_linear)
  W4A8 = 4,               // 4-bit GGUF blocks packed in panels, int8 activations per 32 inputs (block_linear)
  W6A8 = 5,               // Q6_K blocks packed in panels, int8 activations per 32 inputs (block_linear)
  W8A8_RESIDUAL = 6,      // W8A8 with the activations in two int8 passes, about 15 bits (w8a8_residual_linear)
};
constexpr int kLinearKinds = 7;

// One linear: its kind, weight, scale and bias (scale and bias empty where it has none).
struct LinearWeights {
  LinearKind kind = LinearKind::W8A8;
  at::Tensor weight, scale, bias;
};

// What the MLP multiplies `up` by: silu(gate) (SwiGLU, the Llama family) or the tanh-approximated gelu(gate) (GeGLU,
// Gemma).
enum class Activation : int64_t { SILU = 0, GELU_TANH = 1 };

// One decoder layer: its two norms (before attention, before the MLP), the q/k norms of qk-norm models (empty
// otherwise), the norms of the attention's and the MLP's outputs before the residual adds them (Gemma's sandwich
// norms; empty otherwise), its seven linears, and its attention's shape: a sliding window (0: none) that also takes
// the second rope table (local_rope), and the scores' scale (0: head_dim^-1/2). Gemma's norms weigh by (1 + w): the
// kernels take that sum as the weight.
struct LayerWeights {
  at::Tensor input_norm, post_attention_norm, q_norm, k_norm, attention_out_norm, mlp_out_norm;
  LinearWeights q, k, v, o, gate, up, down;
  Activation activation = Activation::SILU;
  int64_t window = 0;
  bool local_rope = false;
  double attention_scale = 0;
  // Whether the layer is a plain Llama-family one (none of Gemma's parts above).
  bool llama_form() const {
    return !attention_out_norm.numel() && !mlp_out_norm.numel() && activation == Activation::SILU && !window &&
           !local_rope && attention_scale == 0;
  }
  // The seven linears in the order of a layer's forward.
  std::array<const LinearWeights*, 7> linears() const { return {&q, &k, &v, &o, &gate, &up, &down}; }
};

// The model's final norm and lm_head, where FusedLayers runs them too.
struct HeadWeights {
  at::Tensor norm;
  LinearWeights lm_head;
};
