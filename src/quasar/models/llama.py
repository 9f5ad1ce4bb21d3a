"""One model file for the Llama family: llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k RMSNorm).

Parameter names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, ...) so safetensors
load without conversion. Shapes: B batch, T new tokens, S cached + new tokens, H heads, H_kv kv heads,
D head dim, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quasar.kv_cache import KVCache
from quasar.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2], with llama3-style or linear `rope_scaling` applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind != "llama3":
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, linear")
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos, sin [T, D]. Rotate-half convention (Hugging Face)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)  # [B, T, H_kv, D]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, H_kv, T, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), *rope)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), *rope)  # [B, H_kv, T, D]
        span = mask.shape[-1] if mask is not None else cache.length + T
        keys, values = cache.update(self.layer, k, v, span)  # [B, H_kv, S, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope, mask, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    """Decoder-only LM. `forward(input_ids, cache)` appends to the cache and returns float32 logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.config, max_len, batch, self.dtype, self.device)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions [T], computed in float32 like the reference."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    # Decode and verify forwards of T <= fixed_rows tokens run padded to exactly fixed_rows rows (dummy
    # tokens after the real ones, their keys written past the cache length and never read) and attend
    # over the whole cache buffer (masked past each row's position). Float kernels round differently for
    # different row counts (GEMV vs GEMM, blockings) and for different key counts (SDPA's blocking), so
    # without this a token scored alone (plain decoding) and inside [last, *draft] (a verify step) can get
    # different logits; with it every row goes through the same kernels at the same shapes, and greedy
    # speculative == greedy plain decoding exactly (for caches of the same size: see Engine.fresh_cache).
    fixed_rows: int = 8

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), float32."""
        T = input_ids.shape[1]
        padded = T <= self.fixed_rows and cache.length + self.fixed_rows <= cache.max_len
        rows = self.fixed_rows if padded else T
        positions = cache.positions(rows)  # [rows]
        mask = None
        if rows > 1:  # query i sees keys 0 .. length + i; a padded step spans the whole buffer
            keys = torch.arange(cache.max_len if padded else cache.length + rows, device=positions.device)
            mask = keys[None, :] <= positions[:, None]  # [rows, S]
        rope = self.rope(positions)
        x = self.model.embed_tokens(F.pad(input_ids, (0, rows - T)))  # [B, rows, hidden]
        for layer in self.model.layers:
            x = layer(x, rope, mask, cache)
        cache.advance(T)
        if not padded:
            return self.lm_head(self.model.norm(x[:, -1:] if last_only else x)).float()
        logits = self.lm_head(self.model.norm(x)).float()  # [B, rows, V]
        return logits[:, T - 1 : T] if last_only else logits[:, :T]
