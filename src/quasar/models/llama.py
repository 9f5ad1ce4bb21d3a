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

from quasar import native
from quasar.kv_cache import KVCache
from quasar.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernel=None) -> torch.Tensor:
        if kernel is not None:  # quasar's CPU kernel (float32): one call, row-independent
            return kernel.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
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


def project(x: torch.Tensor, *linears: nn.Module) -> list[torch.Tensor]:
    """The same input through several linears (q/k/v, gate/up): one call where their type offers
    `forward_many` (quasar's int8 layers quantize x once), else one call each."""
    kind = type(linears[0])
    if hasattr(kind, "forward_many") and all(type(linear) is kind for linear in linears):
        return kind.forward_many(linears, x)
    return [linear(x) for linear in linears]


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

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask, cache: KVCache, kernel=None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = k.view(B, T, self.n_kv, self.head_dim)  # [B, T, H_kv, D]
        v = v.view(B, T, self.n_kv, self.head_dim)  # [B, T, H_kv, D]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q, kernel), self.k_norm(k, kernel)
        if kernel is not None:  # rope, cache write and attention of a few tokens in one call (batch 1)
            cache_k, cache_v = cache.k[self.layer, 0], cache.v[self.layer, 0]  # [H_kv, S, D]
            out = kernel.decode_attention(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1), *rope, cache_k, cache_v, cache.length)
            return self.o_proj(out.view(B, T, self.n_heads * self.head_dim))
        v = v.transpose(1, 2)  # [B, H_kv, T, D]
        q = apply_rope(q.transpose(1, 2), *rope)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), *rope)  # [B, H_kv, T, D]
        span = mask.shape[-1] if mask is not None else cache.length + T
        keys, values = cache.update(self.layer, k, v, span)  # [B, H_kv, S, D]
        rows = mask.shape[0] if mask is not None else T  # > T: queries padded to the fixed shape
        if rows > T:
            q = F.pad(q, (0, 0, 0, rows - T))  # [B, H, rows, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        out = out[:, :, :T]  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def kernel_args(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """The tensors and linear kinds of quasar's fused decoder-layer kernel (csrc/decoder_layer.cpp), or
        None when one of the linears cannot run there."""
        attn, mlp = self.self_attn, self.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        args = [linear.kernel_args() if hasattr(linear, "kernel_args") else None for linear in linears]
        if any(a is None for a in args):
            return None
        none = torch.empty(0)
        norms = [self.input_layernorm.weight, self.post_attention_layernorm.weight]
        norms += [attn.q_norm.weight, attn.k_norm.weight] if hasattr(attn, "q_norm") else [none, none]
        return norms + [t for a in args for t in a[1:]], [a[0] for a in args]

    def forward(self, x: torch.Tensor, rope, mask, cache: KVCache, kernel=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x, kernel), rope, mask, cache, kernel)
        return x + self.mlp(self.post_attention_layernorm(x, kernel))


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
        """The activation (and KV cache) dtype; the embedding table may be stored narrower (bf16)."""
        return self.model.norm.weight.dtype

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

    # A token scored alone (plain decoding) and inside [last, *draft] (a verify step) must get bitwise the
    # same logits, or greedy speculative decoding drifts from greedy plain decoding. Float kernels round a
    # row differently depending on how many rows come with it (GEMV vs GEMM, blockings) and on the key
    # count (SDPA's blocking). Forwards of T <= fixed_rows tokens therefore take one of two paths:
    # - every linear row-independent (`row_independent`: quasar's CPU kernels, quasar.native), batch 1, on
    #   CPU: no padding; attention is quasar's kernel, whose rows read only their own query and keys;
    # - otherwise: attend over the whole cache buffer (masked past each row's position) with the queries
    #   padded to fixed_rows rows and, when some linear is a float GEMM, every op padded to fixed_rows rows
    #   (dummy tokens after the real ones, their keys written past the cache length and never read), so
    #   every row goes through the same kernels at the same shapes (for caches of the same size: see
    #   Engine.fresh_cache).
    fixed_rows: int = 8
    _rows_independent: bool | None = None  # cached by rows_independent(); swapping linears must forget it
    _layer_kernel_args: list | None = None  # cached by layer_kernel_args(); likewise
    _fused_layers: object | None = None  # cached by fused_layers(); likewise

    def rows_independent(self) -> bool:
        """Whether every linear's output rows depend on their own input rows only (checked once)."""
        if self._rows_independent is None:
            linears = [m for m in self.modules() if hasattr(m, "in_features")]
            self._rows_independent = all(getattr(m, "row_independent", False) for m in linears)
        return self._rows_independent

    def forget_row_check(self) -> None:
        """Call after replacing linears (quantization swaps them) so the next forward checks again."""
        self._rows_independent = None
        self._layer_kernel_args = None
        self._fused_layers = None

    def layer_kernel_args(self) -> list | None:
        """Per layer, the arguments of the fused decoder-layer kernel; None unless every layer can use it."""
        if self._layer_kernel_args is None:
            args = [layer.kernel_args() for layer in self.model.layers]
            self._layer_kernel_args = [] if any(a is None for a in args) else args
        return self._layer_kernel_args or None

    def fused_layers(self, kernel):
        """All layers as one kernel object (csrc/decoder_layer.cpp: FusedLayers), built once; None unless
        every layer can use the fused decoder-layer kernel."""
        if self._fused_layers is None:
            args = self.layer_kernel_args()
            if args is None:
                return None
            self._fused_layers = kernel.FusedLayers([a[0] for a in args], [a[1] for a in args], self.config.rms_norm_eps)
        return self._fused_layers

    def attention_kernel(self, batch: int):
        """quasar's CPU attention kernel where this model can use it for decode and verify steps, else None."""
        usable = batch == 1 and self.device.type == "cpu" and self.dtype == torch.float32
        if not (usable and self.config.head_dim % 8 == 0 and self.rows_independent()):
            return None
        return native.kernel()

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), float32."""
        B, T = input_ids.shape
        kernel = self.attention_kernel(B) if T <= self.fixed_rows else None
        fixed = T <= self.fixed_rows and kernel is None and cache.length + self.fixed_rows <= cache.max_len
        pad_all = fixed and not self.rows_independent()
        rows = self.fixed_rows if pad_all else T
        mask = None
        if kernel is None and (fixed or T > 1):  # query i sees keys 0 .. length + i
            query_positions = cache.positions(self.fixed_rows if fixed else T)  # [rows of the attention]
            keys = torch.arange(cache.max_len if fixed else cache.length + T, device=query_positions.device)
            mask = keys[None, :] <= query_positions[:, None]  # [rows, S]
        rope = self.rope(cache.positions(rows))
        x = self.model.embed_tokens(F.pad(input_ids, (0, rows - T))).to(self.dtype)  # [B, rows, hidden]
        fused = self.fused_layers(kernel) if kernel is not None else None
        if fused is not None:  # one kernel call for all layers, no Python in between
            x = fused.forward(x[0], *rope, cache.k[:, 0], cache.v[:, 0], cache.length)[None]  # [1, T, hidden]
        else:
            for layer in self.model.layers:
                x = layer(x, rope, mask, cache, kernel)
        cache.advance(T)
        if pad_all:  # every row through the same shapes, then drop the padding
            logits = self.lm_head(self.model.norm(x)).float()  # [B, rows, V]
            return logits[:, T - 1 : T] if last_only else logits[:, :T]
        return self.lm_head(self.model.norm(x[:, -1:] if last_only else x, kernel)).float()
