// The Python module of quasar's CPU kernels (docs/kernels.md maps which file holds which operation).
#include "attention_rows.h"
#include "int8_dot.h"
#include "kernels.h"

#include <torch/csrc/utils/pybind.h>

// Every kernel runs without the GIL (as PyTorch's own operators do): a server's HTTP thread keeps streaming
// while a forward computes.
using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w8a8_linear", &w8a8_linear, "per-token int8 quantization, exact int32 GEMM, rescale and bias", NoGil());
  m.def("w8a8_residual_linear", &w8a8_residual_linear, "w8a8_linear with the activations in two int8 passes (the "
        "second on the first's rounding residual)", NoGil());
  m.def("w8a8_linear_many", &w8a8_linear_many, "several W8A8 linears of one input, quantized once", NoGil());
  m.def("block_linear", &block_linear, "int8 activations per 32 inputs times GGUF blocks (4-bit, Q6_K) packed in "
        "panels, exact int32 group sums, scales, mins and bias", NoGil());
  m.def("block_linear_many", &block_linear_many, "several GGUF-block linears of one input, quantized once", NoGil());
  m.def("block_linear_on", &block_linear_on, "block_linear_many on a named int8 path (tests: every path's floats)",
        NoGil());
  m.def("int8_mm", &int8_mm, "exact int8 x int8 -> int32 with w [N, K]", pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("path") = "auto", NoGil());
  m.def("int8_group_mm", &int8_group_mm, "group-wise int8 product of quantized q and w with their scales",
        pybind11::arg("q"), pybind11::arg("x_scale"), pybind11::arg("w"), pybind11::arg("w_scale"),
        pybind11::arg("path") = "auto", NoGil());
  m.def("use_int8_path", &use_int8_path, "run every later W8A8 linear on this int8 path ('auto': the fastest); "
        "for benchmarks of what another CPU kind runs; returns the path's name");
  m.def("int8_path", &int8_path, "the int8 path every W8A8 linear runs on now");
  m.def("int8_paths", &int8_paths, "the int8 dot-product paths this CPU runs, fastest first");
  m.def("use_prefetch", &use_prefetch, "how every later int8 weight loop prefetches: 'auto' (l1 on Intel CPUs; l2 on "
        "AMD ones, l1 at one row on maddubs), 'l1' or 'l2'; all give the same results; returns prefetch()");
  m.def("prefetch", &prefetch, "the prefetch setting of the int8 weight loops now, as use_prefetch takes it back");
  m.def("float_act_linear", &float_act_linear, "float32 x times float32, int8 or bfloat16 w, fixed-order fp32 sums", NoGil());
  m.def("bf16_linear", &bf16_linear, "x rounded to bfloat16 times bfloat16 w packed [N/16, K/2, 16, 2], fp32 sums as vdpbf16ps", NoGil());
  m.def("bf16_input", &bf16_input, "x rounded to bfloat16 as the current float path's bf16 products take it", NoGil());
  m.def("bf16_linear_rounded", &bf16_linear_rounded, "bf16_linear of an input bf16_input rounded", NoGil());
  m.def("fp32_linear", &fp32_linear, "float32 x times float32 or bfloat16 (widened) w packed [N/16, K, 16], one FMA chain per output", NoGil());
  m.def("float_paths", &float_paths, "the float-linear paths this CPU runs, fastest first");
  m.def("use_float_path", &use_float_path, "run every later float-activation linear on this path ('auto': the "
        "fastest); all paths give the same floats; returns the path's name");
  m.def("float_path", &float_path, "the path float-activation linears run on now");
  m.def("float_path_for", &float_path_for, "the path bf16_linear (True) or the other float products (False) run on now");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, sums in a fixed order", NoGil());
  m.def("release_results", &release_results, "free the kept blocks of dead kernel results; the bytes freed");
  m.def("argmax_rows", &argmax_rows, "the first index of the largest value of each row, as torch.argmax", NoGil());
  m.def("sampling_weights", &sampling_weights, "exp((logits - max) * inv_t) into out, row by row; the rows' sums", NoGil());
  m.def("filter_cuts", &filter_cuts, "the lowest logit top-k, then top-p, keep in each row [R, 1] (-inf: both off), "
        "by a selection in the row's head (or in one octave of its weights), no sort", NoGil());
  m.def("keep_weights", &keep_weights, "zero the weights whose logit is below the row's threshold; the rows' sums", NoGil());
  m.def("draw_index", &draw_index, "the index where the running float64 sum of weights passes u * total (-1: all 0)", NoGil());
  m.def("decode_attention", &decode_attention, "rope, cache write and causal attention for a few new tokens",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("cache_k"), pybind11::arg("cache_v"), pybind11::arg("start"), pybind11::arg("bf16_products") = false,
        pybind11::arg("window") = 0, pybind11::arg("scale") = 0.0, pybind11::arg("parents") = std::vector<int64_t>{},
        NoGil());
  m.def("bf16_attention", &bf16_attention, "whether attention runs on bfloat16 products (AMX tiles) for a model whose "
        "linears take bfloat16 inputs (True: the bf16 verifier), at this head_dim, on the current float path");
  pybind11::enum_<LinearKind>(m, "LinearKind", "how a linear runs: the kernel FusedLayers calls for it")
      .value("W8A8", LinearKind::W8A8)
      .value("FLOAT_ACTIVATIONS", LinearKind::FLOAT_ACTIVATIONS)
      .value("BF16", LinearKind::BF16)
      .value("PACKED_FP32", LinearKind::PACKED_FP32)
      .value("W4A8", LinearKind::W4A8)
      .value("W6A8", LinearKind::W6A8)
      .value("W8A8_RESIDUAL", LinearKind::W8A8_RESIDUAL);
  pybind11::class_<LinearWeights>(m, "LinearWeights", "one linear: its kind, weight, scale and bias (empty: none)")
      .def(pybind11::init<LinearKind, at::Tensor, at::Tensor, at::Tensor>(), pybind11::arg("kind"),
           pybind11::arg("weight"), pybind11::arg("scale"), pybind11::arg("bias"))
      .def_readwrite("kind", &LinearWeights::kind)
      .def_readwrite("weight", &LinearWeights::weight)
      .def_readwrite("scale", &LinearWeights::scale)
      .def_readwrite("bias", &LinearWeights::bias);
  pybind11::enum_<Activation>(m, "Activation", "what the MLP multiplies up by: silu(gate) or gelu_tanh(gate)")
      .value("SILU", Activation::SILU)
      .value("GELU_TANH", Activation::GELU_TANH);
  pybind11::class_<LayerWeights>(m, "LayerWeights", "one decoder layer's norms and linears, by name")
      .def(pybind11::init<>())
      .def_readwrite("input_norm", &LayerWeights::input_norm)
      .def_readwrite("post_attention_norm", &LayerWeights::post_attention_norm)
      .def_readwrite("q_norm", &LayerWeights::q_norm, "empty without qk-norm")
      .def_readwrite("k_norm", &LayerWeights::k_norm, "empty without qk-norm")
      .def_readwrite("attention_out_norm", &LayerWeights::attention_out_norm, "the attention output's norm (Gemma), or empty")
      .def_readwrite("mlp_out_norm", &LayerWeights::mlp_out_norm, "the MLP output's norm (Gemma), or empty")
      .def_readwrite("activation", &LayerWeights::activation)
      .def_readwrite("window", &LayerWeights::window, "a sliding window's length in keys, 0 for none")
      .def_readwrite("local_rope", &LayerWeights::local_rope, "takes the sliding-window layers' rope tables")
      .def_readwrite("attention_scale", &LayerWeights::attention_scale, "the scores' scale, 0 for head_dim^-1/2")
      .def_readwrite("q", &LayerWeights::q)
      .def_readwrite("k", &LayerWeights::k)
      .def_readwrite("v", &LayerWeights::v)
      .def_readwrite("o", &LayerWeights::o)
      .def_readwrite("gate", &LayerWeights::gate)
      .def_readwrite("up", &LayerWeights::up)
      .def_readwrite("down", &LayerWeights::down);
  pybind11::class_<HeadWeights>(m, "HeadWeights", "the final norm's weight and the lm_head")
      .def(pybind11::init<at::Tensor, LinearWeights>(), pybind11::arg("norm"), pybind11::arg("lm_head"))
      .def_readwrite("norm", &HeadWeights::norm)
      .def_readwrite("lm_head", &HeadWeights::lm_head);
  pybind11::class_<FusedLayers>(m, "FusedLayers", "all decoder layers of a model, tensors handed over once")
      .def(pybind11::init<std::vector<LayerWeights>, double, std::optional<HeadWeights>>(), pybind11::arg("layers"),
           pybind11::arg("eps"), pybind11::arg("head") = pybind11::none())
      .def("forward_segments", &FusedLayers::forward_segments,
           "the rows of several sequences through every layer, each attending over its own cache", NoGil())
      .def("forward_tokens", &FusedLayers::forward_tokens,
           "a whole forward from token ids: embedding, rope rows, every layer, then the final norm and the lm_head "
           "on the picked rows: float32 logits", NoGil())
      .def("one_region", &FusedLayers::one_region,
           "whether a step of this many rows runs every layer in one parallel region (all linears packed W8A8)");
}
