// The part of ATen the files that take tensors use (tensors.cpp, decoder_layer.cpp, packed_w8a8_step.cpp: tensors and
// their options, parallel_for, TORCH_CHECK) instead of <torch/extension.h>: that header (pybind11, autograd, the C++
// frontend) costs a translation unit 20-50 s to compile, this one about 4. A file that calls an ATen op includes that
// op's own header (<ATen/ops/empty.h>, ...); only bindings.cpp includes torch's Python headers, and the kernel files
// none (kernel_ops.h).
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
