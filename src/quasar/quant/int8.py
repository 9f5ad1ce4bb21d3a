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

Int32 backends (registry `INT_MM`): `int_mm` (torch._int_mm; weight stored [N, K] and passed as `.t()`,
faster than a contiguous [K, N] copy in bench/bench_linear.py; rows padded above 16 on CUDA),
`blocked_float` (float32 GEMMs over K blocks of <= 1024, where every partial sum is an integer below 2^24
and therefore exact: the same int32 result), `avx2` (quasar's own kernel, native.py; AVX-512 VNNI's vpdpbusd
inside it where the CPU has it), and `reference` (int64, for tests). `auto` uses `int_mm` on CUDA and, on CPU, the AVX2 kernel fused with the activation quantization
and the rescale (one call per linear), else `blocked_float`: on this AVX2 machine (no VNNI) torch 2.13's CPU
`_int_mm` costs ~3x `blocked_float` at 1 row and ~8x at 6 rows (bench/bench_linear.py). All backends give
bit-identical results, so they can be swapped freely.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from quasar import native

QMAX = 127
NO_BIAS = torch.empty(0)
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
INT_MM: dict[str, IntMM] = {}


def register_int_mm(name: str) -> Callable[[IntMM], IntMM]:
    def wrap(fn: IntMM) -> IntMM:
        INT_MM[name] = fn
        return fn

    return wrap


@register_int_mm("int_mm")
def int_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch._int_mm with the weight [N, K] passed transposed; CUDA needs more than 16 rows, so pad."""
    M = x.shape[0]
    if x.is_cuda and M <= 16:
        x = F.pad(x, (0, 0, 0, 17 - M))
    return torch._int_mm(x, w.t())[:M]


@register_int_mm("blocked_float")
def blocked_float_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 product via float32 GEMMs over K blocks small enough that no sum exceeds 2^24."""
    K = x.shape[1]
    out = None
    for k0 in range(0, K, EXACT_FLOAT_BLOCK):
        part = (x[:, k0 : k0 + EXACT_FLOAT_BLOCK].float() @ w[:, k0 : k0 + EXACT_FLOAT_BLOCK].float().t()).to(torch.int32)
        out = part if out is None else out.add_(part)
    return out


@register_int_mm("reference")
def reference_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int64 matmul: slow, obviously exact; the ground truth for tests."""
    return (x.long() @ w.long().t()).to(torch.int32)


@register_int_mm("avx2")
def avx2_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """quasar's AVX2 kernel (csrc/linear_avx2.cpp): exact int32, weights streamed once per call."""
    kernel = native.kernel()
    if kernel is None:
        raise RuntimeError("the AVX2 int8 kernel is not available on this machine")
    return kernel.int8_mm(x, w)


@register_int_mm("auto")
def auto_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return int_mm(x, w)
    return avx2_mm(x, w) if fused_kernel("auto", x, w.shape[1]) else blocked_float_mm(x, w)


def fused_kernel(backend: str, x: torch.Tensor, in_features: int):
    """The AVX2 kernel that quantizes, multiplies and rescales in one call, where `backend` may use it."""
    if backend not in ("auto", "avx2") or x.device.type != "cpu" or in_features % 16:
        return None
    return native.kernel()


# ---- layers ----------------------------------------------------------------------------------------


class Int8Linear(nn.Module):
    """W8A8 linear: dynamic int8 activations x int8 weights, int32 accumulation; scales per token and output
    channel (group_size 0) or per group of `group_size` inputs of each (see the module docstring)."""

    row_independent = True  # per-token scales and exact int32 sums, on every backend

    def __init__(self, in_features: int, out_features: int, bias: bool, backend: str = "auto", group_size: int = 0) -> None:
        super().__init__()
        if backend not in INT_MM:
            raise ValueError(f"unknown int8 backend {backend!r}; choose from {', '.join(INT_MM)}")
        check_group_size(group_size, in_features)
        self.in_features, self.out_features, self.backend, self.group_size = in_features, out_features, backend, group_size
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

    def kernel_weights(self, kernel) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight, scale) as the kernel reads them: on the dpbusd path a group-wise layer's weights packed 16
        channels x 4 inputs per register ([N/16, K/4, 16, 4], scales [N/16, K/G, 16]; int8_group.cpp), made
        once and kept beside the plain ones (which checkpoints and exports keep using)."""
        if not self.group_size or self.out_features % 16 or kernel.int8_path() != "dpbusd":
            return self.weight, self.weight_scale
        key = (self.weight.data_ptr(), self.weight_scale.data_ptr())
        if getattr(self, "_packed_key", None) != key:
            N, K = self.weight.shape
            self._packed = (
                self.weight.view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3).contiguous(),
                self.weight_scale.view(N // 16, 16, -1).permute(0, 2, 1).contiguous(),
            )
            self._packed_key = key
        return self._packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features)  # [M, K]
        kernel = fused_kernel(self.backend, rows, self.in_features)
        if kernel is not None:  # one call: quantization, exact int32 dot products, rescale, bias
            y = kernel.w8a8_linear(rows.float(), *self.kernel_weights(kernel), NO_BIAS if self.bias is None else self.bias)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        x_int8, x_scale = quantize_tokens(rows, self.group_size)
        if self.group_size:
            y = grouped_product(x_int8, x_scale, self.weight, self.weight_scale, INT_MM[self.backend])
        else:
            acc = INT_MM[self.backend](x_int8, self.weight)  # [M, N] int32
            y = acc.float() * x_scale * self.weight_scale
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(kind 0 = W8A8, weight, scale, bias) for quasar's fused decoder-layer kernel, None where it can't run."""
        kernel = fused_kernel(self.backend, self.weight, self.in_features)
        if kernel is None:
            return None
        return 0, *self.kernel_weights(kernel), NO_BIAS if self.bias is None else self.bias

    @staticmethod
    def forward_many(layers: list[Int8Linear], x: torch.Tensor) -> list[torch.Tensor]:
        """layer(x) for each layer, with x quantized once where the fused kernel runs (bitwise the same)."""
        rows = x.reshape(-1, layers[0].in_features)  # [M, K]
        kernel = fused_kernel(layers[0].backend, rows, layers[0].in_features)
        alike = all((layer.backend, layer.group_size) == (layers[0].backend, layers[0].group_size) for layer in layers)
        if kernel is None or not alike:
            return [layer(x) for layer in layers]
        weights = [layer.kernel_weights(kernel) for layer in layers]
        ys = kernel.w8a8_linear_many(
            rows.float(),
            [w for w, _ in weights],
            [scale for _, scale in weights],
            [NO_BIAS if layer.bias is None else layer.bias for layer in layers],
        )
        return [y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features) for y, layer in zip(ys, layers)]

    def extra_repr(self) -> str:
        groups = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}{groups}"


class Int8WeightOnlyLinear(nn.Module):
    """W8A16 linear: int8 per-channel weights, float activations.

    On CPU with the AVX2 kernel the weights are widened in registers and summed in float32 in a fixed
    order (row-independent, no float copy of the weights); elsewhere they are dequantized for F.linear.
    """

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

    @property
    def row_independent(self) -> bool:
        return fused_kernel("auto", self.weight, self.in_features) is not None

    def kernel_args(self) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(kind 1 = float activations, weight, scale, bias) for the fused decoder-layer kernel, or None."""
        if not self.row_independent:
            return None
        return 1, self.weight, self.weight_scale, NO_BIAS if self.bias is None else self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N]; the per-channel scale is applied after the matmul."""
        kernel = fused_kernel("auto", x, self.in_features)
        if kernel is not None:  # float32 sums of x * int8 weight in a fixed order, then scale and bias
            rows = x.reshape(-1, self.in_features).float()  # [M, K]
            y = kernel.float_act_linear(rows, self.weight, self.weight_scale, NO_BIAS if self.bias is None else self.bias)
            return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        y = F.linear(x, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
        return y + self.bias.to(x.dtype) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
