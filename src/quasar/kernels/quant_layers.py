"""The quantized and bfloat16 linears of quasar.quant on quasar's CPU kernels (csrc/): the same buffers and
names, a new class swapped in at load by quasar.kernels.plan, plus the weight layouts the kernels read, packed
once at load. Each form says which layers it takes (`takes`); quant/ itself never sees the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from quasar.kernels.layers import NONE, KernelModule, LinearKind, pack_channels
from quasar.quant.bf16 import BF16Linear
from quasar.quant.int8 import Int8Linear, Int8WeightOnlyLinear
from quasar.quant.w4a8 import GROUP, W4A8Linear, W6A8Linear


def pack_int8_panels(weight: torch.Tensor, scale: torch.Tensor, unsigned: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] int8, scale [N, K/G] -> (w [N/16, K/4, 16, 4], scale [N/16, K/G, 16]): 16 channels x 4 inputs per
    64 bytes (csrc/int8/int8_panel_avx512.cpp), as unsigned bytes w + 128 (the dpbusd path: w's bits with the sign bit
    flipped) or as the signed bytes w (maddubs, AVX2)."""
    N, K = weight.shape
    values = weight.view(torch.uint8) ^ 0x80 if unsigned else weight
    return (values.view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3).contiguous(),
            scale.view(N // 16, 16, -1).permute(0, 2, 1).contiguous())


class KernelInt8Linear(KernelModule, Int8Linear):
    """Int8Linear on quasar's CPU kernel: quantization, exact int32 dot products, rescale and bias in one call.
    A group-wise layer's weights are packed 16 channels x 4 inputs per 64 bytes at load ([N/16, K/4, 16, 4],
    scales [N/16, K/G, 16]; csrc/int8/int8_panel_avx512.cpp): unsigned bytes w + 128 on the dpbusd path, signed bytes on
    maddubs; beside the plain ones, which checkpoints and exports keep using; a loaded verifier keeps the packed
    copy alone."""

    kernel_weight: tuple[torch.Tensor, torch.Tensor]  # (weight, scale) as the kernel reads them

    @staticmethod
    def takes(layer: Int8Linear) -> bool:
        """The torch path's `auto` product on a CPU tensor whose inputs fill 16-byte lanes (the other backends
        stay on torch: tests and references pin them)."""
        return layer.backend == "auto" and layer.weight.device.type == "cpu" and layer.in_features % 16 == 0

    @classmethod
    def adopt(cls, layer: Int8Linear, kernel: Any) -> KernelInt8Linear:
        super().adopt(layer, kernel)
        path = kernel.int8_path()
        if layer.group_size and layer.out_features % 16 == 0 and path in ("dpbusd", "maddubs"):
            layer.kernel_weight = pack_int8_panels(layer.weight, layer.weight_scale, unsigned=path == "dpbusd")
        else:
            layer.kernel_weight = (layer.weight, layer.weight_scale)
        return layer

    def drop_plain_(self) -> bool:
        """Keep only the packed copy (the weight and scale buffers become it): for a model nobody reads in the
        plain layout afterwards (plan.prepare_ with owned); whether there was a second copy."""
        if self.kernel_weight[0] is self.weight:
            return False
        self.weight, self.weight_scale = self.kernel_weight
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        product = self.kernel.w8a8_residual_linear if self.activation_passes == 2 else self.kernel.w8a8_linear
        y = product(rows, *self.kernel_weight, NONE if self.bias is None else self.bias)  # [M, N]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[LinearKind, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kind, weight, scale, bias) for quasar's fused decoder-layer kernel: W8A8 (W8A8_RESIDUAL with two
        activation passes)."""
        kind = LinearKind.W8A8_RESIDUAL if self.activation_passes == 2 else LinearKind.W8A8
        return kind, *self.kernel_weight, NONE if self.bias is None else self.bias

    @staticmethod
    def forward_many(layers: list[KernelInt8Linear], x: torch.Tensor) -> list[torch.Tensor]:
        """layer(x) for each layer with x quantized once (bitwise the same as one call each)."""
        if any(layer.group_size != layers[0].group_size for layer in layers):
            return [layer(x) for layer in layers]
        rows = x.reshape(-1, layers[0].in_features).float()  # [M, K]
        ys = layers[0].kernel.w8a8_linear_many(
            rows,
            [layer.kernel_weight[0] for layer in layers],
            [layer.kernel_weight[1] for layer in layers],
            [NONE if layer.bias is None else layer.bias for layer in layers],
        )
        return [y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features) for y, layer in zip(ys, layers)]


def nibble_panels(q: torch.Tensor) -> torch.Tensor:
    """The low 4 bits of quants q [N, K] as csrc/blocks/w4a8_layout.h and w6a8_layout.h lay them out: [N/16, K/32, 256] uint8,
    per group 4 chunks of 8 inputs, each 16 channels x 4 bytes, byte j of a channel holding inputs 8t + j (low nibble)
    and 8t + 4 + j (high nibble)."""
    N, K = q.shape
    low = (q & 0x0F).view(N // 16, 16, K // GROUP, 4, 2, 4)  # [panel, channel, group, chunk, nibble, byte]
    return (low[..., 0, :] | (low[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(N // 16, K // GROUP, 256)


def per_block(t: torch.Tensor) -> torch.Tensor:
    """float16 block scales [N, nb] -> [N/16, nb, 32] bytes: each block's 16 channels side by side."""
    N, nb = t.shape
    return t.view(N // 16, 16, nb).transpose(1, 2).contiguous().view(torch.uint8)


# Channels packed at a time: the packing's temporaries (several times the quants' bytes) stay a few MB even for a
# 152k-row lm_head, whose whole quants take 233 MB a byte each.
PACK_CHANNELS = 2048


def packed_by_channels(pack: Callable[[slice], tuple[torch.Tensor, torch.Tensor]], N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """pack(rows) over the channels in ranges of PACK_CHANNELS (multiples of 16), written into one (panels, block
    scales) pair [N/16, ...]: the same tensors as one pack(slice(None))."""
    out: tuple[torch.Tensor, torch.Tensor] | None = None
    for n0 in range(0, N, PACK_CHANNELS):
        n1 = min(N, n0 + PACK_CHANNELS)
        panels, scales = pack(slice(n0, n1))
        if out is None:
            out = panels.new_empty(N // 16, *panels.shape[1:]), scales.new_empty(N // 16, *scales.shape[1:])
        out[0][n0 // 16 : n1 // 16] = panels
        out[1][n0 // 16 : n1 // 16] = scales
    assert out is not None
    return out


def pack_w4_panels(layer: W4A8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A W4A8Linear's blocks as csrc/blocks/w4a8_layout.h reads them: (panels [N/16, K/32, 256] uint8 (nibble_panels; [..,
    320] for 5-bit quants, whose 16 channels x 4 more bytes hold the fifth bit of input 8t + 4h + j of a channel in
    bit 2t + h of its byte j), block scales [N/16, K/B, 64 + B] uint8: d[16] and dmin[16] as float16, then sc[16] and
    m[16] for each group of the block; [N/16, K/32, 64], d and dmin alone, where B is 32 and every sc and m is 1, as in
    Q4_0, Q4_1, Q5_0 and Q5_1 files)."""
    K, B = layer.in_features, layer.block
    G, nb = K // GROUP, K // B
    unit = B == GROUP and bool((layer.sc == 1).all()) and bool((layer.m == 1).all())

    def pack(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        q = layer.quants(rows)
        P = q.shape[0] // 16
        panels = nibble_panels(q)
        if layer.bits == 5:
            shifts = torch.arange(8, dtype=torch.uint8).view(4, 2, 1)  # bit 2t + h
            fifth = ((q.view(P, 16, G, 4, 2, 4) >> 4) << shifts).sum((3, 4), dtype=torch.uint8)  # [P, 16, G, 4]: the OR
            panels = torch.cat([panels, fifth.permute(0, 2, 1, 3).reshape(P, G, 64)], -1)
        groups = torch.stack([layer.sc[rows].view(P, 16, nb, B // GROUP), layer.m[rows].view(P, 16, nb, B // GROUP)],
                             dim=-1)
        groups = groups.permute(0, 2, 3, 4, 1).reshape(P, nb, 2 * B // GROUP * 16)  # [P, nb, per group: sc[16], m[16]]
        heads = [per_block(layer.d[rows]), per_block(layer.dmin[rows])]
        return panels, torch.cat(heads if unit else [*heads, groups], dim=-1)

    return packed_by_channels(pack, layer.out_features)


def pack_w6_panels(layer: W6A8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A W6A8Linear's Q6_K blocks as csrc/blocks/w6a8_layout.h reads them: (panels [N/16, K/32, 384] uint8: per group the
    quants' low 4 bits (nibble_panels), then two 64-byte vectors of their high 2 bits, one per sub-block u of 16
    inputs, byte j of a channel holding those of inputs 16u + j, 16u + 4 + j, 16u + 8 + j and 16u + 12 + j (bits 0-1,
    2-3, 4-5, 6-7); block scales [N/16, K/256, 288] uint8: d[16] as float16, then sc[16] for each of its 16
    sub-blocks)."""
    K = layer.in_features
    G, nb = K // GROUP, K // W6A8Linear.BLOCK

    def pack(rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        q = layer.qweight[rows]
        P = q.shape[0] // 16
        high = (q >> 4).view(P, 16, G, 2, 4, 4)  # [.., sub-block, quarter (inputs 4i .. 4i + 3), byte]
        high = high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4) | (high[..., 3, :] << 6)
        high = high.permute(0, 2, 3, 1, 4).reshape(P, G, 128)
        sc = layer.sc[rows].view(P, 16, nb, 16).permute(0, 2, 3, 1).reshape(P, nb, 256).view(torch.uint8)
        return torch.cat([nibble_panels(q), high], -1), torch.cat([per_block(layer.d[rows]), sc], -1)

    return packed_by_channels(pack, layer.out_features)


class KernelBlocks(KernelModule):
    """What the kernel forms of GGUF-block linears share (csrc/blocks/block_linear.cpp): the blocks packed once at load in
    panels of 16 channels by PACK, run on the int8 path's instruction set (vpdpbusd on AVX-512 VNNI, maddubs on AVX2)
    with the same floats on each; a loaded verifier keeps the packed copy alone."""

    KIND: LinearKind
    PACK: Any  # layer -> (panels, block scales)
    PLAIN: tuple[str, ...]  # the buffers of the plain blocks
    kernel_weight: tuple[torch.Tensor, torch.Tensor]  # (panels, block scales)

    @staticmethod
    def takes(layer: nn.Module) -> bool:
        return layer.qweight.device.type == "cpu" and layer.out_features % 16 == 0

    @classmethod
    def adopt(cls, layer: nn.Module, kernel: Any) -> nn.Module:
        super().adopt(layer, kernel)
        layer.kernel_weight = cls.PACK(layer)
        return layer

    def drop_plain_(self) -> bool:
        """Keep only the packed copy: the plain blocks become empty."""
        if not self.qweight.numel():
            return False
        for name in self.PLAIN:
            if getattr(self, name, None) is not None:
                setattr(self, name, torch.empty(0, dtype=getattr(self, name).dtype))
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return KernelBlocks.forward_many([self], x)[0]

    def kernel_args(self) -> tuple[LinearKind, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kind, weight, scale, bias) for the fused decoder-layer kernel: panels and block scales."""
        return self.KIND, *self.kernel_weight, NONE if self.bias is None else self.bias

    @staticmethod
    def forward_many(layers: list[KernelBlocks], x: torch.Tensor) -> list[torch.Tensor]:
        """layer(x) for each layer with x quantized once (bitwise the same as one call each; 4- and 6-bit mixed)."""
        rows = x.reshape(-1, layers[0].in_features).float()  # [M, K]
        ys = layers[0].kernel.block_linear_many(rows, [layer.kernel_weight[0] for layer in layers],
                                                [layer.kernel_weight[1] for layer in layers],
                                                [NONE if layer.bias is None else layer.bias for layer in layers])
        return [y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features) for y, layer in zip(ys, layers)]


class KernelW4A8Linear(KernelBlocks, W4A8Linear):
    """W4A8Linear on quasar's CPU kernel (csrc/blocks/w4a8_layout.h)."""

    KIND, PACK, PLAIN = LinearKind.W4A8, staticmethod(pack_w4_panels), ("qweight", "qhigh", "d", "dmin", "sc", "m")


class KernelW6A8Linear(KernelBlocks, W6A8Linear):
    """W6A8Linear on quasar's CPU kernel (csrc/blocks/w6a8_layout.h)."""

    KIND, PACK, PLAIN = LinearKind.W6A8, staticmethod(pack_w6_panels), ("qweight", "d", "sc")


class KernelInt8WeightOnlyLinear(KernelModule, Int8WeightOnlyLinear):
    """W8A16 on quasar's CPU kernel: weights widened in registers, float32 sums in a fixed order."""

    @staticmethod
    def takes(layer: Int8WeightOnlyLinear) -> bool:
        return layer.weight.device.type == "cpu" and layer.in_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        y = self.kernel.float_act_linear(rows, self.weight, self.weight_scale, NONE if self.bias is None else self.bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[LinearKind, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kind, weight, scale, bias) for the fused decoder-layer kernel: float activations."""
        return LinearKind.FLOAT_ACTIVATIONS, self.weight, self.weight_scale, NONE if self.bias is None else self.bias


class KernelBF16Linear(KernelModule, BF16Linear):
    """The kernel reads the weight packed in panels of 16 channels, made at load: [N/16, K/2, 16, 2] with bf16
    inputs, [N/16, K, 16] with float32 ones (plain [N, K] where N is not a multiple of 16); a loaded verifier
    then drops the plain weight unless a tied embedding reads it (kernels/layers.drop_plain_weights_)."""

    packed: torch.Tensor | None

    @staticmethod
    def takes(layer: BF16Linear) -> bool:
        if layer.weight.device.type != "cpu":
            return False
        if layer.bf16_inputs:  # panels of 16 channels, inputs in pairs
            return layer.out_features % 16 == 0 and layer.in_features % 2 == 0
        return layer.in_features % 16 == 0

    @classmethod
    def adopt(cls, layer: BF16Linear, kernel: Any) -> KernelBF16Linear:
        super().adopt(layer, kernel)
        if layer.bf16_inputs:
            layer.packed = pack_panels(layer.weight)
        else:
            layer.packed = None if layer.out_features % 16 else pack_channels(layer.weight)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        kind, weight, scale, bias = self.kernel_args()
        if kind == LinearKind.BF16:
            y = self.kernel.bf16_linear(rows, weight, bias)  # [M, N] float32
        elif kind == LinearKind.PACKED_FP32:
            y = self.kernel.fp32_linear(rows, weight, bias)
        else:
            y = self.kernel.float_act_linear(rows, weight, scale, bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def kernel_bias(self) -> torch.Tensor:
        return NONE if self.bias is None else self.bias.float()

    def kernel_args(self) -> tuple[LinearKind, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kind, weight, scale, bias) for the fused decoder-layer kernel: bfloat16 inputs (bf16_linear), float32
        inputs on packed weights (fp32_linear), or float32 inputs on the plain weight."""
        if self.bf16_inputs:
            return LinearKind.BF16, self.packed, NONE, self.kernel_bias()
        if self.packed is not None:
            return LinearKind.PACKED_FP32, self.packed, NONE, self.kernel_bias()
        return LinearKind.FLOAT_ACTIVATIONS, self.weight, NONE, self.kernel_bias()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [N/16, K/2, 16, 2]: 16 channels side by side, each with its pair of inputs (csrc/float/float_dot.h)."""
    N, K = weight.shape
    return weight.view(N // 16, 16, K // 2, 2).transpose(1, 2).contiguous()
