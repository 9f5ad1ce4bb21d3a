"""Quantization: SmoothQuant calibration and smoothing, int8 layers (W8A8, W8A16), quantized checkpoints."""

from quasar.quant.int8 import Int8Linear, Int8WeightOnlyLinear
from quasar.quant.schemes import W8A8Config, W8A16Config, quantize_

__all__ = ["Int8Linear", "Int8WeightOnlyLinear", "W8A8Config", "W8A16Config", "quantize_"]
