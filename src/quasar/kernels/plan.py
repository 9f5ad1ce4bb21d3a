"""The one switch between quasar's CPU kernels and plain torch, decided once per model, at load, and kept as the
model's ExecutionPlan (quasar.model.execution).

`prepare_(model)` swaps modules (as torchao and gpt-fast do): where quasar's kernels run (quasar.kernels.native) and
every linear of the model has a kernel form that takes it (KERNEL_FORMS: float32, bf16, int8 and W8A16 layers), norms,
attention and the layer stack become their kernel forms (kernels/layers.py) and decode/verify steps run
all layers in one kernel call. Anywhere else (CUDA, no compiler, a shape the kernels do not take) the model stays on the
torch modules of model/llama.py, which keep every decode/verify step at one fixed shape. Either way greedy
speculative decoding gives plain decoding's tokens bit for bit; nothing asks again: every reader takes
`model.plan`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from quasar.kernels import native
from quasar.kernels.layers import (
    FusedLayers,
    KernelAttention,
    KernelLinear,
    KernelModule,
    KernelRMSNorm,
    LinearKind,
    drop_plain_weights_,
    layer_kinds,
)
from quasar.kernels.quant_layers import (
    KernelBF16Linear,
    KernelInt8Linear,
    KernelInt8WeightOnlyLinear,
    KernelW4A8Linear,
    KernelW6A8Linear,
)
from quasar.model.execution import ON_TORCH, ExecutionPlan
from quasar.model.llama import Attention, Layers, Linear, RMSNorm, Transformer
from quasar.quant.bf16 import BF16Linear
from quasar.quant.int8 import Int8Linear, Int8WeightOnlyLinear
from quasar.quant.w4a8 import W4A8Linear, W6A8Linear


RELEASE_EVERY = 16  # modules packed between two returns of freed memory to the system while an owned model is packed


def kernel_for(model: Transformer) -> Any | None:
    """quasar's kernel module where this model can run on it (CPU, float32 activations, head_dim % 8 == 0)."""
    if model.device.type != "cpu" or model.dtype != torch.float32 or model.config.head_dim % 8:
        return None
    return native.kernel()


def prepare_(model: Transformer, fuse: bool = True,
             owned: bool = False) -> ExecutionPlan:
    """Put model on quasar's kernels where every part of it can run there, else leave it on torch; returns the plan
    (paths 'kernels:dpbusd+avx512bf16', 'kernels:avx2', ... or 'torch'), also kept as model.plan. Idempotent: a model
    already on the kernels (a layer-skip view of one, say) only gets its stack rebuilt. owned: nothing else reads
    the model's weights, so the linears the kernels read packed (fp32, bf16 inputs) keep only that copy
    (kernels/layers.drop_plain_weights_). fuse=False keeps the layers as separate module calls."""
    kernel = kernel_for(model)
    forms = {m: kernel_form(m) for m in model.modules() if isinstance(m, LINEARS)}
    if kernel is None or any(form is None for form in forms.values()):
        model.plan = ON_TORCH
        return model.plan
    forms.update({m: KernelRMSNorm for m in model.modules() if type(m) is RMSNorm})
    forms.update({m: KernelAttention for m in model.modules() if type(m) is Attention})
    for i, (module, form) in enumerate(forms.items()):
        if type(module) is not form:
            form.adopt(module, kernel)
        if owned and hasattr(module, "drop_plain_"):  # as each is packed: a 4-bit model's plain blocks (a byte a
            module.drop_plain_()  # weight) and all its panels would otherwise be held side by side
            if i % RELEASE_EVERY == 0:  # and the plain blocks' pages go back as it goes, not all at the end
                native.release_memory()
    if owned:
        drop_plain_weights_(model)
    stack = model.model.layers
    for layer in stack:  # every linear of the layer takes bf16 inputs (the bf16 verifier): the fused layer's rule
        layer.self_attn.bf16_products = all(kind == LinearKind.BF16 for kind in layer_kinds(layer))
    bf16_products = any(layer.self_attn.bf16_products for layer in stack)
    stack.__class__ = FusedLayers if fuse else Layers
    if fuse:
        stack.build(kernel, model.config.rms_norm_eps, model.model.norm, model.lm_head)
    bf16_attention = kernel.bf16_attention(bf16_products, model.config.head_dim)
    model.plan = ExecutionPlan(kernel_paths(kernel, forms, bf16_attention), fused=fuse, batches_rows=fuse,
                               bf16_attention=bf16_attention, kernel=kernel)
    return model.plan


def pack_early_(linear: nn.Module, kernel: Any) -> None:
    """One linear packed for the kernels as a model is built, its plain weights dropped (a model that only the
    verifier reads, whose load would otherwise hold every layer's plain blocks and then their panels); prepare_
    later finds it in its kernel form. A linear the kernels do not take stays as it is, for prepare_ to decide."""
    form = kernel_form(linear)
    if form is None:
        return
    if type(linear) is not form:
        form.adopt(linear, kernel)
    if hasattr(linear, "drop_plain_"):
        linear.drop_plain_()


def kernel_paths(kernel: Any, modules: dict[nn.Module, type], bf16_attention: bool = False) -> str:
    """'kernels:' and the instruction-set paths the linears run on: the int8 path of W8A8 ones, the
    float path of the others ('kernels:dpbusd+avx512' for w8a8:lmbf16, a W8A8 model with a bf16 lm_head widened to
    float32; 'kernels:amx' for bf16, whose bf16 x bf16 products run on AMX tiles where the CPU has them), then
    'bf16-attention' where attention too runs on bfloat16 products ('kernels:amx+bf16-attention': the bf16 verifier on
    AMX; float32 attention everywhere else)."""
    linear_forms = set(KERNEL_FORMS.values())
    kinds = {module.kernel_args()[0] for module, form in modules.items() if form in linear_forms}
    int8 = {LinearKind.W8A8, LinearKind.W8A8_RESIDUAL, LinearKind.W4A8, LinearKind.W6A8}
    floats = [kernel.float_path_for(LinearKind.BF16 in kinds)] if kinds - int8 else []
    paths = ([kernel.int8_path()] if kinds & int8 else []) + floats + (["bf16-attention"] if bf16_attention else [])
    return "kernels:" + "+".join(paths)


# each linear class -> its kernel form, which says which of its layers it takes
KERNEL_FORMS: dict[type, type] = {
    Linear: KernelLinear,  # float32 weights (the fp32 verifier)
    BF16Linear: KernelBF16Linear,
    Int8Linear: KernelInt8Linear,
    Int8WeightOnlyLinear: KernelInt8WeightOnlyLinear,
    W4A8Linear: KernelW4A8Linear,
    W6A8Linear: KernelW6A8Linear,
}


LINEARS = (nn.Linear, Int8Linear, Int8WeightOnlyLinear, W4A8Linear, W6A8Linear)  # every linear a model may hold


def kernel_form(linear: nn.Module) -> type | None:
    """The kernel class a linear becomes (its own class if it is one already), None if it has none."""
    if isinstance(linear, KernelModule):
        return type(linear)
    form = KERNEL_FORMS.get(type(linear))
    return form if form is not None and form.takes(linear) else None


def on_kernel(module: nn.Module, kernel: Any | None = None) -> nn.Module:
    """One module moved onto quasar's kernels in place (tests and benchmarks of single layers)."""
    kernel = kernel or native.kernel()
    form = kernel_form(module) if not isinstance(module, (RMSNorm, Attention)) else (
        KernelRMSNorm if isinstance(module, RMSNorm) else KernelAttention)
    if kernel is None or form is None:
        raise ValueError(f"{type(module).__name__} cannot run on quasar's kernels here ({native.status()})")
    return form.adopt(module, kernel) if type(module) is not form else module
