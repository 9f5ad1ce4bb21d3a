"""Gemma 3 (gemma3_text) on the Llama family's modules, with what Gemma changes: RMSNorm weights applied as
(1 + w) in float32, a norm before and after both attention and the MLP (sandwich norms), q/k RMSNorm, GeGLU (the
tanh-approximated GELU), embeddings scaled by sqrt(hidden), the attention scale 1 / sqrt(query_pre_attn_scalar),
and sliding-window attention on most layers (each key within the last `sliding_window` positions of its query)
with a RoPE base of its own, global attention with the model's base on the others. Hugging Face parameter
names (`model.layers.0.pre_feedforward_layernorm.weight`, ...), as Gemma3ForCausalLM.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from quasar.model.config import ModelConfig
from quasar.model.kv_cache import KVCache, ring_size
from quasar.model.llama import (
    MLP,
    Attention,
    Backbone,
    Embedding,
    RMSNorm,
    Transformer,
    project,
    scaled,
)
from quasar.model.rope import rope_inv_freq

# The most tokens a forward writes into a cache whose sliding-window layers keep rings (Gemma3.new_cache): longer
# prefills run in pieces of this many.
RING_ROWS = 128


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), all in float32, then cast back (Gemma's order; Llama casts before the weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.normalized(x) * (1.0 + self.weight.float())).to(x.dtype)

    def kernel_weight(self) -> torch.Tensor:
        """1 + w, computed as forward computes it (a copy: the kernels see w as it was when they took it)."""
        return 1.0 + self.weight.detach().float()

    @torch.no_grad()
    def divide_(self, s: torch.Tensor) -> None:
        """Divide the output by s [dim]: (1 + w) / s = 1 + ((1 + w) / s - 1)."""
        self.weight.copy_((1.0 + self.weight) / s - 1.0)


class ScaledEmbedding(Embedding):
    """Token embeddings times sqrt(hidden), the scale rounded to the table's dtype first (as Hugging Face does)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = math.sqrt(embedding_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return scaled(super().forward(ids), self.multiplier)


class Ropes(NamedTuple):
    """cos, sin of a step for the global layers and for the sliding-window layers."""

    full: tuple[torch.Tensor, torch.Tensor]
    sliding: tuple[torch.Tensor, torch.Tensor]


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.window = config.sliding_window if config.sliding_layers[layer] else None
        self.local_rope = config.sliding_layers[layer]
        self.scale = config.query_pre_attn_scalar ** -0.5

    def rope_of(self, rope: Ropes) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.sliding if self.local_rope else rope.full

    def visible(self, mask: torch.Tensor | None, cache: KVCache, T: int) -> torch.Tensor | None:
        """The causal mask, less the keys at least `window` positions behind the query on a sliding layer."""
        if self.window is None or cache.length + T <= self.window:
            return mask
        rows, span = (mask.shape[0], mask.shape[1]) if mask is not None else (T, cache.length + T)
        return sliding_mask(cache.length, rows, span, self.window, cache.k.device)


@functools.lru_cache(maxsize=1)
def sliding_mask(start: int, rows: int, span: int, window: int, device: torch.device) -> torch.Tensor:
    """[rows, span]: query row r (position start + r) sees the keys of the last `window` positions up to its own.
    The causal mask (quasar.model.llama.attention_mask) with the window applied; the same for every sliding layer
    of a step, so computed once a step (the last one is kept)."""
    queries = torch.arange(start, start + rows, device=device)[:, None]  # [rows, 1]
    keys = torch.arange(span, device=device)[None, :]  # [1, S]
    return (keys <= queries) & (keys > queries - window)


class GeGLU(MLP):
    activation = "gelu_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Norms before and after attention and the MLP; the residual adds the post-norm's output."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, layer)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GeGLU(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, rope: Ropes, mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3(Transformer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.reset_rope()

    def backbone(self, config: ModelConfig) -> nn.Module:
        return Backbone(config, GemmaDecoderLayer, GemmaRMSNorm, ScaledEmbedding)

    def reset_rope(self) -> None:
        super().reset_rope()
        self.inv_freq_local = rope_inv_freq(dataclasses.replace(self.config, rope_theta=self.config.rope_local_theta))

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        """On the fused kernels, a cache longer than twice its ring keeps the sliding layers in rings (KVCache): their
        memory no longer grows with the context."""
        window = self.config.sliding_window
        rings = self.plan.fused and batch == 1 and window and max_len > 2 * ring_size(window, RING_ROWS)
        return KVCache(self.config, max_len, batch, self.dtype, self.device, RING_ROWS if rings else 0)

    def rope_tables(self, n: int) -> list[torch.Tensor]:
        return [*self.rope_table(n), *self.rope_table(n, "inv_freq_local")]

    def rope_span(self, start: int, n: int) -> Ropes:  # type: ignore[override]
        return Ropes(super().rope_span(start, n), super().rope_span(start, n, "inv_freq_local"))

    def rope(self, positions: torch.Tensor) -> Ropes:  # type: ignore[override]
        return Ropes(super().rope(positions), super().rope(positions, "inv_freq_local"))
