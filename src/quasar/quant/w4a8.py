"""The linears of the w4a8 verifier: GGUF's quantized blocks as the file holds them, times dynamic int8 activations
with one scale per 32 inputs, exact int32 dot products per group of 32.

W4A8Linear: 4-bit weights in blocks with scales and mins (Q4_0, Q4_1 and Q4_K).

    w[n, k] = S[n, g] * q[n, k] - M[n, g]    q in [0, 15], g = k / 32,  S = d * sc,  M = dmin * m (exact products)
    y[m, n] = sum_g (float(q[n, g] . x[m, g]) * S[n, g] - M[n, g] * float(xsum[m, g])) * x_scale[m, g]   (+ bias)

x[m, g] are the row's int8 inputs of group g (quant.int8.quantize_tokens with G = 32, as the w8a8 verifier's) and
xsum their sum: the mins cost one product per group, not per weight (llama.cpp's Q4_K dot products take the mins
the same way). The groups are summed in order, each float operation rounded as written (no fused multiply-add): this
module is the reference quasar's kernels (kernels/quant_layers.KernelW4A8Linear) give bit for bit, and a row's
result depends on its own input only.

W6A8Linear: Q6_K's 6-bit weights, one signed scale per sub-block of 16 inputs (sc) and float16 d per 256:

    w[n, k] = S[n, s] * (q[n, k] - 32)    q in [0, 63], s = k / 16,  S = d * sc (exact)
    y[m, n] = sum_g (D[a] * S[n, a] + D[b] * S[n, b]) * x_scale[m, g]   D[s] = q[n, s] . x[m, s] - 32 * xsum16[m, s]

with a and b the two sub-blocks of group g and D exact integers (KernelW6A8Linear gives its floats bit for bit).
"""

from __future__ import annotations

import torch
from torch import nn

from quasar.quant.int8 import quantize_tokens

GROUP = 32


class W4A8Linear(nn.Module):
    """The weights as blocks (quasar.model.gguf_blocks.FourBitBlocks): q nibble pairs [N, K/2] uint8 (q[2i] in the low
    nibble), d and dmin [N, K/block] float16, sc and m [N, K/32] uint8."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: int = 256) -> None:
        super().__init__()
        if block % GROUP or in_features % block:
            raise ValueError(f"W4A8 blocks of {block} inputs must be a multiple of 32 dividing K = {in_features}")
        self.in_features, self.out_features, self.block = in_features, out_features, block
        N, K = out_features, in_features
        self.register_buffer("qweight", torch.zeros(N, K // 2, dtype=torch.uint8))
        self.register_buffer("d", torch.zeros(N, K // block, dtype=torch.float16))
        self.register_buffer("dmin", torch.zeros(N, K // block, dtype=torch.float16))
        self.register_buffer("sc", torch.zeros(N, K // GROUP, dtype=torch.uint8))
        self.register_buffer("m", torch.zeros(N, K // GROUP, dtype=torch.uint8))
        self.register_buffer("bias", torch.zeros(N) if bias else None)  # [N] float32

    @classmethod
    def from_blocks(cls, blocks, bias: torch.Tensor | None = None) -> W4A8Linear:
        """From FourBitBlocks (q [N, K] in [0, 15])."""
        N, K = blocks.q.shape
        layer = cls(K, N, bias is not None, blocks.block)
        q = blocks.q.view(N, K // 2, 2)
        layer.qweight = (q[..., 0] | (q[..., 1] << 4)).contiguous()
        layer.d, layer.dmin = blocks.d.contiguous(), blocks.dmin.contiguous()
        layer.sc, layer.m = blocks.sc.contiguous(), blocks.m.contiguous()
        if bias is not None:
            layer.bias = bias.detach().float().clone()
        return layer

    def quants(self) -> torch.Tensor:
        """q [N, K] uint8 in [0, 15]."""
        return torch.stack([self.qweight & 0x0F, self.qweight >> 4], dim=-1).view(self.out_features, self.in_features)

    def group_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(S, M) [N, K/32] float32: each group's scale d * sc and min dmin * m."""
        per = self.block // GROUP
        S = self.d.float().repeat_interleave(per, 1) * self.sc.float()
        M = self.dmin.float().repeat_interleave(per, 1) * self.m.float()
        return S, M

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] the blocks hold."""
        S, M = self.group_scales()
        q = self.quants().float().view(self.out_features, -1, GROUP)
        return (S[..., None] * q - M[..., None]).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        x_int8, x_scale = quantize_tokens(rows, GROUP)  # [M, K], [M, K/32]
        xq = x_int8.float().view(rows.shape[0], -1, GROUP)  # [M, K/32, 32]
        xsum = xq.sum(-1)  # [M, K/32], exact
        q = self.quants().float().view(self.out_features, -1, GROUP)  # [N, K/32, 32]
        S, M = self.group_scales()
        y = torch.zeros(rows.shape[0], self.out_features, device=rows.device)
        for g in range(S.shape[1]):  # in order, as the kernels' lanes
            dot = xq[:, g] @ q[:, g].t()  # [M, N]: integers below 2^24, exact in float32
            y = y + (dot * S[:, g] - M[:, g] * xsum[:, g : g + 1]) * x_scale[:, g : g + 1]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


class W6A8Linear(nn.Module):
    """Q6_K blocks (quasar.model.gguf_blocks.SixBitBlocks): q [N, K] uint8 in [0, 63], d [N, K/256] float16, sc [N, K/16]
    int8."""

    BLOCK = 256
    SUB = 16

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        if in_features % self.BLOCK:
            raise ValueError(f"Q6_K blocks of 256 inputs must divide K = {in_features}")
        self.in_features, self.out_features = in_features, out_features
        N, K = out_features, in_features
        self.register_buffer("qweight", torch.zeros(N, K, dtype=torch.uint8))
        self.register_buffer("d", torch.zeros(N, K // self.BLOCK, dtype=torch.float16))
        self.register_buffer("sc", torch.zeros(N, K // self.SUB, dtype=torch.int8))
        self.register_buffer("bias", torch.zeros(N) if bias else None)  # [N] float32

    @classmethod
    def from_blocks(cls, blocks, bias: torch.Tensor | None = None) -> W6A8Linear:
        N, K = blocks.q.shape
        layer = cls(K, N, bias is not None)
        layer.qweight, layer.d, layer.sc = blocks.q.contiguous(), blocks.d.contiguous(), blocks.sc.contiguous()
        if bias is not None:
            layer.bias = bias.detach().float().clone()
        return layer

    def sub_scales(self) -> torch.Tensor:
        """S [N, K/16] float32: d * sc of each sub-block."""
        return self.d.float().repeat_interleave(self.BLOCK // self.SUB, 1) * self.sc.float()

    def dequantize(self) -> torch.Tensor:
        q = self.qweight.float().view(self.out_features, -1, self.SUB) - 32
        return (self.sub_scales()[..., None] * q).view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x's dtype."""
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        x_int8, x_scale = quantize_tokens(rows, GROUP)  # [M, K], [M, K/32]
        xq = x_int8.float().view(rows.shape[0], -1, self.SUB)  # [M, K/16, 16]
        xsum = xq.sum(-1)  # [M, K/16], exact
        q = self.qweight.float().view(self.out_features, -1, self.SUB)  # [N, K/16, 16]
        S = self.sub_scales()
        y = torch.zeros(rows.shape[0], self.out_features, device=rows.device)
        for g in range(x_scale.shape[1]):  # in order, as the kernels' lanes
            a, b = 2 * g, 2 * g + 1
            dot_a = xq[:, a] @ q[:, a].t() - 32 * xsum[:, a : a + 1]  # [M, N]: exact integers
            dot_b = xq[:, b] @ q[:, b].t() - 32 * xsum[:, b : b + 1]
            y = y + (dot_a * S[:, a] + dot_b * S[:, b]) * x_scale[:, g : g + 1]
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, Q6_K"
