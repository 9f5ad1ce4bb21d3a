// The part of ATen every kernel file uses (tensors and their options, parallel_for, TORCH_CHECK) instead of
// <torch/extension.h>: that header (pybind11, autograd, the C++ frontend) costs a translation unit 20-50 s to
// compile, this one a few. A file that calls an ATen op includes that op's own header (<ATen/ops/empty.h>, ...);
// only bindings.cpp includes torch's Python headers.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
