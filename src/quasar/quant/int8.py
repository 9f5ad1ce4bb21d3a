"""Int8 linear layers: W8A8 (int8 weights, dynamic per-token int8 activations) and W8A16 (int8 weights only).

Weights are symmetric int8 per output channel: w ~ w_int8 [N, K] * w_scale [N]. Activations are quantized
per token (row) at run time: x ~ x_int8 [M, K] * x_scale [M, 1], scale = row absmax / 127 (1 for an
all-zero row, which then stays zero). The int8 x int8 product is accumulated exactly in int32 and rescaled:
y = (x_int8 @ w_int8.T) * x_scale * w_scale + bias.

Group-wise W8A8 (`group_size` G, as llama.cpp's Q8_0 with G = 32): one scale per output channel and group
of G inputs, w_scale [N, K/G], and one per token and group, x_scale [M, K/G]; each group's int8 product is
exact in int32 and y = sum_g x_scale[:, g] * w_scale[:, g] * (x_int8[:, g] @ w_int8[:, g].T) + bias.
Finer scales follow outliers closely: on the default model KL(float || w8a8) falls from 0.011 per
channel/token to 0.0013 with G = 32 (docs/quantization.md).

Per-token scales make a row's result independent of the other rows in the batch, and int32 accumulation
is exact, so verifying k draft tokens together gives bit-identical rows to decoding them one at a time.

Int32 products of the torch path (table `INT_MM`): `int_mm` (torch._int_mm; weight stored [N, K] and passed
as `.t()`; rows padded above 16 on CUDA), `blocked_float` (float32 GEMMs over K blocks of <= 1024, where every
partial sum is an integer below 2^24 and therefore exact) and `reference` (int64, for tests); `auto` is
`int_mm` on CUDA, else `blocked_float`. All give the same integers.
On a CPU where quasar's kernels run, quasar.kernels.plan moves `auto` layers onto KernelInt8Linear at load:
activation quantization, exact int32 dot products (AVX-512 VNNI's vpdpbusd where the CPU has it, else AVX2),
rescale and bias in one call per linear.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quasar.model.llama import at_fixed_shape

QMAX = 127
EXACT_FLOAT_BLOCK = 1024  # 1024 * 127 * 127 < 2**24: float32 sums of this many int8 products are exact


def quantize_groups(t: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """t [R, K] -> (int8 [R, K], scale [R, K/G] float32): symmetric, one scale per row and group of G
    columns (G = 0: the whole row); an all-zero group gets scale 1 and stays zero."""
    t = t.float()
    R, K = t.shape
    G = group_size or K
    groups = t.view(R, K // G, G)  # [R, K/G, G]
    absmax = groups.abs().amax(dim=2, keepdim=True)  # [R, K/G, 1]
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    return torch.round(groups / scale).clamp_(-QMAX, QMAX).to(torch.int8).view(R, K), scale[..., 0]


def dequantize(t_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 [R, K] with its scales ([R], [R, 1] or [R, K/G]) -> float32 [R, K]."""
    R, K = t_int8.shape
    scale = scale.reshape(R, -1)  # [R, K/G]
    return (t_int8.float().view(R, scale.shape[1], -1) * scale[..., None]).view(R, K)


def quantize_weight(weight: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (int8 [N, K], scale float32): [N] per output channel, [N, K/G] per group."""
    w_int8, scale = quantize_groups(weight, group_size)
    return w_int8, scale if group_size else scale[:, 0]


def quantize_tokens(x: torch.Tensor, group_size: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], scale float32): [M, 1] per token, [M, K/G] per token and group."""
    return quantize_groups(x, group_size)


def check_group_size(group_size: int, in_features: int, name: str = "a linear") -> None:
    """G = 0 (per channel / per token), or a multiple of 32 that divides the layer's K."""
    if group_size and (group_size % 32 or in_features % group_size):
        raise ValueError(f"group size {group_size} does not divide the {in_features} inputs of {name} "
                         "(it must be a multiple of 32 that divides every quantized layer's input size)")


def grouped_product(x_int8, x_scale, w_int8, w_scale, int_mm) -> torch.Tensor:
    """sum_g x_scale[:, g] * w_scale[:, g] * int_mm(x_int8[:, g], w_int8[:, g]) -> [M, N] float32.
    x_int8 [M, K], x_scale [M, K/G], w_int8 [N, K], w_scale [N, K/G]."""
    G = x_int8.shape[1] // x_scale.shape[1]
    y = None
    for g in range(x_scale.shape[1]):
        cols = slice(g * G, (g + 1) * G)
        part = int_mm(x_int8[:, cols].contiguous(), w_int8[:, cols].contiguous()).float()  # [M, N], exact
        part = part * x_scale[:, g : g + 1] * w_scale[:, g]
        y = part if y is None else y.add_(part)
    return y


# ---- int8 x int8 -> int32 backends ---------------------------------------------------------------

IntMM = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x_int8 [M, K], w_int8 [N, K]) -> int32 [M, N]


def int_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch._int_mm with the weight [N, K] passed transposed; CUDA needs more than 16 rows, so pad."""
    M = x.shape[0]
    if x.is_cuda and M <= 16:
        x = F.pad(x, (0, 0, 0, 17 - M))
    return torch._int_mm(x, w.t())[:M]


def blocked_float_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 product via float32 GEMMs over K blocks small enough that no sum exceeds 2^24."""
    K = x.shape[1]
    out = None
    for k0 in range(0, K, EXACT_FLOAT_BLOCK):
        part = (x[:, k0 : k0 + EXACT_FLOAT_BLOCK].float() @ w[:, k0 : k0 + EXACT_FLOAT_BLOCK].float().t()).to(torch.int32)
        out = part if out is None else out.add_(part)
    return out


def reference_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int64 matmul: slow, obviously exact; the ground truth for tests."""
    return (x.long() @ w.long().t()).to(torch.int32)


def auto_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The torch path's product (layers that run on quasar's kernels never get here): int_mm on CUDA."""
    return int_mm(x, w) if x.is_cuda else blocked_float_mm(x, w)


# name -> (x_int8 [M, K], w_int8 [N, K]) -> int32 [M, N]; all give the same integers
INT_MM: dict[str, IntMM] = {
    "auto": auto_mm,
    "int_mm": int_mm,
    "blocked_float": blocked_float_mm,
    "reference": reference_mm,
}


# ---- layers ----------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """W8A8 linear: dynamic int8 activations x int8 weights, int32 accumulation; scales per token and output
    channel (group_size 0) or per group of `group_size` inputs of each (see the module docstring).

    activation_passes 2: the activations' int8 rounding residual is quantized again and multiplied too,
    y = W (s1 q1) + W (s2 q2) with s2 about s1 / 254, so the products see about 15 bits of each input for twice
    the int8 work over the same weight bytes (a head whose 8-bit weights are a file's own, where activation
    rounding is the larger error)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: str = "auto", group_size: int = 0,
                 activation_passes: int = 1) -> None:
        super().__init__()
        if backend not in INT_MM:
            raise ValueError(f"unknown int8 backend {backend!r}; choose from {', '.join(INT_MM)}")
        if activation_passes not in (1, 2):
            raise ValueError(f"activation_passes must be 1 or 2, got {activation_passes}")
        check_group_size(group_size, in_features)
        self.in_features, self.out_features, self.backend, self.group_size = in_features, out_features, backend, group_size
        self.activation_passes = activation_passes
        scale_shape = (out_features, in_features // group_size) if group_size else (out_features,)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))  # [N, K]
        self.register_buffer("weight_scale", torch.ones(scale_shape))  # [N] or [N, K/G] float32
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)  # [N] float32

    @classmethod
    def from_float(cls, linear: nn.Linear, backend: str = "auto", group_size: int = 0) -> Int8Linear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, backend, group_size)
        layer.weight, layer.weight_scale = quantize_weight(linear.weight.detach(), group_size)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().float().clone()
        return layer.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        x_int8, x_scale = quantize_tokens(rows, self.group_size)
        y = self.product(x_int8, x_scale)
        if self.activation_passes == 2:  # the rounding residual, quantized again
            r_int8, r_scale = quantize_tokens(rows - dequantize(x_int8, x_scale), self.group_size)
            y = y + self.product(r_int8, r_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def product(self, x_int8: torch.Tensor, x_scale: torch.Tensor) -> torch.Tensor:
        """The rescaled product of quantized rows with the weight, before the bias -> [M, N] float32."""
        if self.group_size:
            return grouped_product(x_int8, x_scale, self.weight, self.weight_scale, INT_MM[self.backend])
        acc = INT_MM[self.backend](x_int8, self.weight)  # [M, N] int32
        return acc.float() * x_scale * self.weight_scale

    def extra_repr(self) -> str:
        groups = f", group_size={self.group_size}" if self.group_size else ""
        passes = ", activation_passes=2" if self.activation_passes == 2 else ""
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, backend={self.backend}{groups}{passes}"


class Int8WeightOnlyLinear(nn.Module):
    """W8A16 linear: int8 per-channel weights, float activations (dequantized for F.linear on the torch
    path, at the fixed shape of model/llama.py; KernelInt8WeightOnlyLinear on quasar's kernel)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))  # [N, K]
        self.register_buffer("weight_scale", torch.ones(out_features))  # [N] float32
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)  # [N] float32

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8WeightOnlyLinear:
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None)
        layer.weight, layer.weight_scale = quantize_weight(linear.weight.detach())
        if linear.bias is not None:
            layer.bias = linear.bias.detach().float().clone()
        return layer.to(linear.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]; the per-channel scale is applied after the matmul."""
        def op(rows: torch.Tensor) -> torch.Tensor:
            y = F.linear(rows, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
            return y + self.bias.to(x.dtype) if self.bias is not None else y

        return at_fixed_shape(op, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
