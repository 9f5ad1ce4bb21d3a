"""BF16Linear: bfloat16 weights, float32 activations and sums, on quasar's AVX2 kernel where it runs.

This CPU has no bfloat16 arithmetic, so PyTorch's bf16 GEMM converts and runs slowly at a few rows (a
bf16 model decoded slower than fp32 here). The kernel (csrc/linear_avx2.cpp, `float_act_linear`) widens
each weight to float32 in registers and sums in a fixed order: half the bytes of fp32, and every row of
the result depends on its own input row only (`row_independent`), so verify rows equal decode rows.
Elsewhere (CUDA, no kernel) it is a plain bf16 `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quasar import native
from quasar.quant.schemes import swap_module_

NO_TENSOR = torch.empty(0)


def _kernel(x: torch.Tensor, in_features: int):
    if x.device.type != "cpu" or in_features % 16:
        return None
    return native.kernel()


class BF16Linear(nn.Linear):
    """nn.Linear with a bfloat16 weight [N, K] (state dicts and exports see a plain linear)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> BF16Linear:
        with torch.device("meta"):
            layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        layer.weight = nn.Parameter(linear.weight.detach().to(torch.bfloat16), requires_grad=False)  # shared if bf16
        layer.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        return layer

    @property
    def row_independent(self) -> bool:
        return _kernel(self.weight, self.in_features) is not None

    def kernel_args(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(kind 1 = float activations, weight, scale, bias) for the fused decoder-layer kernel, or None."""
        if not self.row_independent:
            return None
        return 1, self.weight, NO_TENSOR, NO_TENSOR if self.bias is None else self.bias.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        kernel = _kernel(x, self.in_features)
        if kernel is None:
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        bias = NO_TENSOR if self.bias is None else self.bias.float()
        y = kernel.float_act_linear(rows, self.weight, NO_TENSOR, bias)  # [M, N] float32
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def use_bf16_linears_(model: nn.Module, names: list[str] | None = None) -> list[str]:
    """Swap the named nn.Linear modules (default: all) for BF16Linear in place, on a CPU where the kernel
    runs (elsewhere nothing changes); returns the names swapped."""
    if native.kernel() is None or any(p.device.type != "cpu" for p in model.parameters()):
        return []
    if names is None:
        names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in names:
        swap_module_(model, name, BF16Linear.from_linear(model.get_submodule(name)))
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
    if hasattr(model, "forget_row_check"):
        model.forget_row_check()
