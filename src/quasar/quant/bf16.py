"""BF16Linear: bfloat16 weights, float32 sums, and float32 or bfloat16 inputs.

Two kinds, fixed when the layer is made:
- float32 inputs (the bf16 lm_head of `w8a8:lmbf16` checkpoints): each weight is widened to float32 in registers, exactly
  (csrc/float/float_dot.cpp: `fp32_linear` on panels of 16 channels, `float_act_linear` where N is not a multiple of 16);
- bfloat16 inputs (`bf16_inputs`, every linear of the bf16 verifier, as llama.cpp runs a BF16 model): the
  input rows are rounded to bfloat16 and multiplied with AVX512-BF16's vdpbf16ps where the CPU has it, the
  same two FMAs per pair elsewhere (`bf16_linear`): the same floats on every x86 host.
Either way half the bytes of fp32, and every row of the result depends on its own input row only.
Elsewhere (CUDA, no kernel) it is F.linear on the weight cast to the activations' dtype (inputs rounded
through bfloat16 first for the second kind), at the fixed shape of model/llama.py. quasar.kernels.plan picks
the kernel at load (KernelBF16Linear).
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from quasar.model.llama import Linear, at_fixed_shape
from quasar.quant.schemes import swap_module_



class BF16Linear(Linear):
    """A Linear with a bfloat16 weight [N, K] (state dicts and exports see a plain linear)."""

    bf16_inputs = False  # round the input rows to bfloat16 (vdpbf16ps) instead of multiplying them as float32

    @classmethod
    def from_linear(cls, linear: nn.Linear, bf16_inputs: bool = False) -> BF16Linear:
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.bf16_inputs = bf16_inputs
        layer.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)  # shared if bf16
        layer.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.bf16_inputs:
            x = x.to(torch.bfloat16).to(x.dtype)
        return at_fixed_shape(lambda rows: F.linear(rows, self.weight.to(x.dtype), bias), x)

def use_bf16_linears_(model: nn.Module, names: list[str] | None = None, bf16_inputs: bool = False) -> list[str]:
    """Swap the named float linears (default: all) for BF16Linear in place (with bfloat16 inputs if asked);
    returns the names swapped. A tied lm_head keeps sharing its (now bf16) table with the embedding."""
    if names is None:
        names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, BF16Linear)]
    for name in names:
        swap_module_(model, name, BF16Linear.from_linear(model.get_submodule(name), bf16_inputs))
    if "lm_head" in names and getattr(model.config, "tie_word_embeddings", False):
        model.model.embed_tokens.weight = model.lm_head.weight  # still tied: lookups read the bf16 rows
    return names


def float32_activations_(model: nn.Module) -> None:
    """Every parameter outside the BF16Linear layers and embeddings (norms, ...) to float32, so activations
    and the KV cache run in float32 while the linears read bf16 weights. Embeddings stay bf16 (tied ones
    shared with the lm_head); the model casts the rows it looks up."""
    shared = {m.weight.data_ptr() for m in model.modules() if isinstance(m, BF16Linear)}
    for module in model.modules():
        if isinstance(module, (BF16Linear, nn.Embedding)):  # an embedding is looked up, not multiplied
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dtype != torch.float32 and param.is_floating_point() and param.data_ptr() not in shared:
                setattr(module, name, nn.Parameter(param.detach().float(), requires_grad=False))
