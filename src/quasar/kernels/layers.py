"""The model's modules on quasar's CPU kernels (csrc/): the same parameters and names as model/llama.py,
swapped in once at load by quasar.kernels.plan where every part of a model can run there.

Every row of every kernel's result depends on its own input row alone, so steps need no fixed shapes: a
step of any length (decode, verify, prefill) runs all layers in one kernel call (FusedLayers), and so do
the rows of several sequences at once, each attending over its own cache (continuous batching).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import torch
from torch import nn

from quasar.model.kv_cache import KVCache
from quasar.model.llama import Attention, Embedding, Layers, Linear, RMSNorm

NONE = torch.empty(0)


class LinearKind(IntEnum):
    """How a linear runs in the fused kernels: the C++ enum LinearKind (csrc/base/linear_kind.h), whose names and values
    check_linear_kinds compares with these when a process first takes the kernels."""

    W8A8 = 0  # int8 weight, per-token int8 activations (w8a8_linear)
    FLOAT_ACTIVATIONS = 1  # float32 activations, plain float32, int8 (per-channel scale) or bfloat16 weight
    BF16 = 2  # bfloat16 activations, packed bfloat16 weight (bf16_linear)
    PACKED_FP32 = 3  # float32 activations, packed float32 or widened bfloat16 weight (fp32_linear)
    W4A8 = 4  # 4-bit GGUF blocks packed in panels, int8 activations per 32 inputs (block_linear)
    W6A8 = 5  # Q6_K blocks packed in panels, int8 activations per 32 inputs (block_linear)
    W8A8_RESIDUAL = 6  # W8A8 with the activations in two int8 passes, about 15 bits (w8a8_residual_linear)


def check_linear_kinds(kernel: Any) -> None:
    """Raise if the kernels' LinearKind is not this one, name for name and value for value."""
    theirs = {name: int(kind) for name, kind in kernel.LinearKind.__members__.items()}
    ours = {kind.name: int(kind) for kind in LinearKind}
    if theirs != ours:
        raise RuntimeError(f"the kernels' LinearKind {theirs} is not quasar.kernels.layers.LinearKind {ours}")


class KernelModule:
    """A module on quasar's kernels, made from its torch form in place (same parameters, new class). The
    kernel module (one per process) is a class attribute, so such a module still deep-copies."""

    kernel: Any = None

    @classmethod
    def adopt(cls, module: nn.Module, kernel: Any) -> nn.Module:
        assert KernelModule.kernel in (None, kernel), "one kernel module per process"
        if KernelModule.kernel is None and kernel is not None:
            check_linear_kinds(kernel)
        KernelModule.kernel = kernel
        module.__class__ = cls
        return module


class KernelLinear(KernelModule, Linear):
    """A float32 linear (the fp32 verifier) on the float kernel: its weight packed in panels of 16 channels
    ([N/16, K, 16], made at load), one float32 FMA chain per output, any row count."""

    packed: torch.Tensor

    @staticmethod
    def takes(layer: Linear) -> bool:
        return layer.weight.dtype == torch.float32 and layer.weight.device.type == "cpu" and layer.out_features % 16 == 0

    @classmethod
    def adopt(cls, module: nn.Module, kernel: Any) -> nn.Module:
        super().adopt(module, kernel)
        module.packed = pack_channels(module.weight.detach())
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # [M, K] float32
        y = self.kernel.fp32_linear(rows, self.packed, NONE if self.bias is None else self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def kernel_args(self) -> tuple[LinearKind, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(kind, weight, scale, bias) for the fused decoder-layer kernel: packed float32."""
        return LinearKind.PACKED_FP32, self.packed, NONE, NONE if self.bias is None else self.bias


def pack_channels(weight: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [N/16, K, 16]: 16 channels side by side for each input (fp32_linear's layout, any dtype)."""
    N, K = weight.shape
    return weight.view(N // 16, 16, K).transpose(1, 2).contiguous()


def drop_plain_weights_(model: nn.Module) -> int:
    """Float linears that the kernels read packed (`packed`) give up their plain weight [N, K] for the packed
    tensor: one copy of each weight in memory. A tied embedding then looks its rows up in the packed table
    (PanelEmbedding); a weight any other module shares keeps its plain copy. Only for a model nobody reads in the
    plain layout afterwards (a loaded verifier); returns how many. The quantized linears drop their own plain copy
    (`drop_plain_()`, called by plan.prepare_ as each is packed)."""
    readers: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            readers.setdefault(param.data_ptr(), []).append(module)
    dropped = 0
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is None or module.weight.shape == packed.shape:
            continue
        others = [m for m in readers[module.weight.data_ptr()] if m is not module]
        if not all(type(m) is Embedding and m.weight.shape == module.weight.shape for m in others):
            continue
        module.weight = nn.Parameter(packed, requires_grad=False)
        for embedding in others:
            embedding.__class__ = PanelEmbedding
            embedding.weight = module.weight
        dropped += 1
    return dropped


class PanelEmbedding(Embedding):
    """An embedding tied to an lm_head whose table the kernels read packed in panels of 16 rows ([V/16, D, 16]
    or [V/16, D/2, 16, 2], pack_channels or kernels/quant_layers.pack_panels): a lookup gathers each token's row from
    its panel, the same values as the plain table's row."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids // 16, :, ids % 16].reshape(*ids.shape, self.embedding_dim)


class KernelRMSNorm(KernelModule, RMSNorm):

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernel.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)


class KernelAttention(KernelModule, Attention):
    """Rope, cache write and attention of a step (batch 1) in one kernel call; batches > 1 as torch. bf16_products:
    the model's linears take bfloat16 inputs (the bf16 verifier), so the kernel may run attention on bfloat16 products
    too (`kernel.bf16_attention`), as the fused layers do for the same model."""

    bf16_products = False

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        if B != 1:
            return super().forward(x, rope, mask, cache)
        q, k, v = self.qkv(x)
        cache_k, cache_v = cache.k[self.layer, 0], cache.v[self.layer, 0]  # [H_kv, S, D]
        out = self.kernel.decode_attention(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), *rope, cache_k, cache_v,
                                           cache.length, self.bf16_products)
        return self.o_proj(out.view(B, T, self.n_heads * self.head_dim))


class FusedLayers(Layers):
    """All decoder layers as one kernel object (csrc/layers/decoder_layer.cpp), built once from the layers' tensors;
    every step (batch 1) makes one call for the whole stack, and so does a step over several sequences. Built
    with the model's final norm and lm_head (`tail`), the same call also returns the logits (`logits`): after a
    forward has streamed the weights through the caches each Python-level operation costs tens of microseconds,
    and the tail was six of them."""

    fused: Any
    tail: tuple[nn.Module, nn.Module] | None  # (final norm, lm_head) the kernel object runs, if any

    def build(self, kernel: Any, eps: float, norm: nn.Module | None = None, head: nn.Module | None = None) -> None:
        self.tail = None if norm is None or head is None else (norm, head)
        tail = kernel.HeadWeights(norm.kernel_weight(), linear_weights(kernel, head)) if self.tail else None
        self.fused = kernel.FusedLayers([layer_weights(kernel, layer) for layer in self], eps, tail)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache) -> torch.Tensor:
        if x.shape[0] != 1:
            return super().forward(x, rope, cache)
        return self.forward_segments(x[0], rope, [cache], [x.shape[1]])[None]  # [1, T, hidden]

    def forward_segments(self, x: torch.Tensor, rope: Any, caches: list[KVCache], rows: list[int]) -> torch.Tensor:
        """x [N, hidden]: rows[i] new tokens of sequence i, one sequence after another, each attending over
        its own cache (all distinct); appends them to the caches -> [N, hidden]. rope: the model's cos, sin of the
        rows (or Gemma's Ropes of two such pairs)."""
        pairs = rope if isinstance(rope[0], tuple) else (rope,)
        x = self.fused.forward_segments(x, [t for pair in pairs for t in pair], *self.cache_args(caches), rows, [])
        self.advance(caches, rows)
        return x

    def logits(self, ids: list[int], embedding: torch.Tensor, rope: list[torch.Tensor], caches: list[KVCache],
               rows: list[int], picked: list[int], trees: list[list[int]] | None = None) -> torch.Tensor:
        """A whole forward in one call: ids [N] (rows[i] new tokens of sequence i, one sequence after another) looked
        up in `embedding` (the embedding module's table), rope rows read from the tables `rope` (cos, sin [L, D], then
        the sliding-window layers' pair if any: Transformer.rope_tables) at each sequence's positions, every layer, then
        the tail on the rows `picked` -> float32 logits [picked, V]. trees: none, or per sequence its rows' parent rows
        (a draft tree, quasar.model.llama.Rows; [] a chain)."""
        logits = self.fused.forward_tokens(ids, embedding, rope, *self.cache_args(caches), rows, picked, trees or [])
        self.advance(caches, rows)
        return logits

    @staticmethod
    def cache_args(caches: list[KVCache]) -> tuple[list[torch.Tensor], ...]:
        """The caches as the kernels take them: keys, values, the rings' keys and values (none: no rings), starts."""
        rings = [c for c in caches if c.ring]
        if rings and len(rings) < len(caches):
            raise ValueError("the caches of one step all keep rings or none does")
        return ([c.k[:, 0] for c in caches], [c.v[:, 0] for c in caches], [c.ring_k[:, 0] for c in rings],
                [c.ring_v[:, 0] for c in rings], [c.length for c in caches])

    @staticmethod
    def advance(caches: list[KVCache], rows: list[int]) -> None:
        for cache, n in zip(caches, rows):
            cache.advance(n)


LAYER_LINEARS = {  # LayerWeights' name for each linear of a decoder layer: (its module, its name there)
    "q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "v": ("self_attn", "v_proj"), "o": ("self_attn", "o_proj"),
    "gate": ("mlp", "gate_proj"), "up": ("mlp", "up_proj"), "down": ("mlp", "down_proj"),
}


def layer_linears(layer: nn.Module) -> dict[str, nn.Module]:
    """A decoder layer's seven linears by LayerWeights' names, in the order of its forward."""
    return {name: getattr(getattr(layer, part), attr) for name, (part, attr) in LAYER_LINEARS.items()}


def layer_kinds(layer: nn.Module) -> list[LinearKind]:
    """How each linear of a decoder layer runs in the fused kernels, in the order of its forward."""
    return [linear.kernel_args()[0] for linear in layer_linears(layer).values()]


def linear_weights(kernel: Any, linear: nn.Module) -> Any:
    """A linear's `kernel_args()` as the kernels' LinearWeights."""
    kind, weight, scale, bias = linear.kernel_args()
    return kernel.LinearWeights(kernel.LinearKind.__members__[LinearKind(kind).name], weight, scale, bias)


def layer_weights(kernel: Any, layer: nn.Module) -> Any:
    """The kernels' LayerWeights of one decoder layer, built by name: a Llama-family layer, or Gemma's, whose
    post_attention_layernorm is the attention output's norm and pre_feedforward_layernorm the MLP input's."""
    weights = kernel.LayerWeights()
    attn = layer.self_attn
    weights.input_norm = layer.input_layernorm.kernel_weight()
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma's sandwich norms
        weights.post_attention_norm = layer.pre_feedforward_layernorm.kernel_weight()
        weights.attention_out_norm = layer.post_attention_layernorm.kernel_weight()
        weights.mlp_out_norm = layer.post_feedforward_layernorm.kernel_weight()
    else:
        weights.post_attention_norm = layer.post_attention_layernorm.kernel_weight()
    qk_norm = hasattr(attn, "q_norm")
    weights.q_norm = attn.q_norm.kernel_weight() if qk_norm else NONE
    weights.k_norm = attn.k_norm.kernel_weight() if qk_norm else NONE
    weights.activation = kernel.Activation.__members__[layer.mlp.activation.upper()]
    weights.window = attn.window or 0
    weights.local_rope = attn.local_rope
    weights.attention_scale = attn.scale or 0.0
    for name, linear in layer_linears(layer).items():
        setattr(weights, name, linear_weights(kernel, linear))
    return weights
