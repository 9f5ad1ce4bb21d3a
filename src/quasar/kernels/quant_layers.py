"""The quantized and bfloat16 linears of quasar.quant on quasar's CPU kernels (csrc/): the same buffers and
names, a new class swapped in at load by quasar.kernels.plan, plus the weight layouts the kernels read, packed
once at load. Each form says which layers it takes (`takes`); quant/ itself never sees the kernels.
"""

from __future__ import annotations

from typing import Any

import torch

from quasar.kernels.layers import NONE, KernelModule, LinearKind, pack_channels
from quasar.quant.bf16 import BF16Linear
from quasar.quant.int8 import Int8Linear, Int8WeightOnlyLinear


def pack_int8_panels(weight: torch.Tensor, scale: torch.Tensor, unsigned: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] int8, scale [N, K/G] -> (w [N/16, K/4, 16, 4], scale [N/16, K/G, 16]): 16 channels x 4 inputs per
    64 bytes (csrc/int8_panel.cpp), as unsigned bytes w + 128 (the dpbusd path: w's bits with the sign bit
    flipped) or as the signed bytes w (maddubs, AVX2)."""
    N, K = weight.shape
    values = weight.view(torch.uint8) ^ 0x80 if unsigned else weight
    return (values.view(N // 16, 16, K // 4, 4).permute(0, 2, 1, 3).contiguous(),
            scale.view(N // 16, 16, -1).permute(0, 2, 1).contiguous())


class KernelInt8Linear(KernelModule, Int8Linear):
    """Int8Linear on quasar's CPU kernel: quantization, exact int32 dot products, rescale and bias in one call.
    A group-wise layer's weights are packed 16 channels x 4 inputs per 64 bytes at load ([N/16, K/4, 16, 4],
    scales [N/16, K/G, 16]; csrc/int8_panel.cpp): unsigned bytes w + 128 on the dpbusd path, signed bytes on
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
        plain layout afterwards (kernels/layers.drop_plain_weights_); whether there was a second copy."""
        if self.kernel_weight[0] is self.weight:
            return False
        self.weight, self.weight_scale = self.kernel_weight
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()  # [M, K]
        y = self.kernel.w8a8_linear(rows, *self.kernel_weight, NONE if self.bias is None else self.bias)  # [M, N]
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[LinearKind, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kind, weight, scale, bias) for quasar's fused decoder-layer kernel: W8A8."""
        return LinearKind.W8A8, *self.kernel_weight, NONE if self.bias is None else self.bias

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
    """w [N, K] -> [N/16, K/2, 16, 2]: 16 channels side by side, each with its pair of inputs (csrc/float_dot.cpp)."""
    N, K = weight.shape
    return weight.view(N // 16, 16, K // 2, 2).transpose(1, 2).contiguous()
