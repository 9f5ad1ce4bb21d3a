"""One model file for the Llama family: llama, mistral, qwen2 (q/k/v bias), qwen3 (q/k RMSNorm).

Parameter names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`, ...) so safetensors
load without conversion. Shapes: B batch, T new tokens, S cached + new tokens, H heads, H_kv kv heads,
D head dim, V vocab.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from quasar.model.config import ModelConfig
from quasar.model.execution import ON_TORCH
from quasar.model.kv_cache import KVCache
from quasar.model.rope import apply_rope, rope_inv_freq, rope_values
from quasar.spec import MAX_DRAFT

# A token scored alone (plain decoding) and inside [last, *draft] (a verify step) must get bitwise the same
# logits, or greedy speculative decoding drifts from greedy plain decoding. Float GEMMs round a row
# differently depending on how many rows come with it, and SDPA depending on the key count. So on this
# torch path every forward of at most FIXED_ROWS tokens runs at one shape: float linears pad their input to
# FIXED_ROWS rows, attention pads its queries to FIXED_ROWS rows and attends over the whole cache buffer
# (masked past each row's position; see Engine.fresh_cache for why buffers of one request have one size).
# quasar's CPU kernels (kernels/layers.py, swapped in at load by quasar.kernels.plan) compute every row
# from its own input alone and need none of this.
FIXED_ROWS = MAX_DRAFT + 1


def at_fixed_shape(op, x: torch.Tensor) -> torch.Tensor:
    """op(x) for x [..., K] with a row-wise op, run on x's rows padded with zero rows to FIXED_ROWS when they
    are fewer (so one token alone and inside a verify step take the same GEMM shape)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    M = rows.shape[0]
    y = op(F.pad(rows, (0, 0, 0, FIXED_ROWS - M)))[:M] if M < FIXED_ROWS else op(rows)  # [M, N]
    return y.reshape(*x.shape[:-1], y.shape[-1])


class Linear(nn.Linear):
    """nn.Linear (same parameters and names) whose GEMM runs at one shape for up to FIXED_ROWS rows."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # a model built on the meta device to load weights into needs no init
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return at_fixed_shape(lambda rows: F.linear(rows, self.weight, self.bias), x)


class Embedding(nn.Embedding):
    multiplier: float | None = None  # what looked-up rows are multiplied by (Gemma's sqrt(hidden)), if anything

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # skipping meta init saves ~1 s of first-use imports at start-up
            super().reset_parameters()

    def kernel_table(self, ids: list[int]) -> tuple[list[int], torch.Tensor]:
        """What the fused kernels look the tokens up in: (ids, the table), or these tokens' rows as a table of their
        own where rows are scaled."""
        return (ids, self.weight) if self.multiplier is None else rows_table(self, ids, self.weight.device)


def rows_table(embedding: nn.Module, ids: list[int], device: torch.device) -> tuple[list[int], torch.Tensor]:
    """These tokens' rows as the fused kernels' table of their own: (0 .. N - 1, the rows)."""
    return list(range(len(ids))), embedding(torch.tensor(ids, device=device))


def scaled(rows: torch.Tensor, multiplier: float | None) -> torch.Tensor:
    """Embedding rows times the multiplier, rounded to the rows' dtype first (as Hugging Face scales Gemma's)."""
    if multiplier is None:
        return rows
    return rows * torch.tensor(multiplier, dtype=rows.dtype, device=rows.device)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def normalized(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) in float32."""
        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * self.normalized(x).to(x.dtype)

    def kernel_weight(self) -> torch.Tensor:
        """What the kernels' rms_norm multiplies x / rms(x) by."""
        return self.weight

    @torch.no_grad()
    def divide_(self, s: torch.Tensor) -> None:
        """Divide the output by s [dim] (SmoothQuant folds its scales into the norm)."""
        self.weight.div_(s)


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
        self.q_proj = Linear(hidden, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, T, H, D], k, v [B, T, H_kv, D] (q/k normed where the model has qk_norm)."""
        B, T, _ = x.shape
        q, k, v = project(x, self.q_proj, self.k_proj, self.v_proj)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    scale: float | None = None  # the attention scale; None: 1 / sqrt(D)
    window: int | None = None  # a sliding window's length in keys (Gemma's sliding layers); None: causal over all
    local_rope = False  # takes the model's second rope pair (Gemma's sliding layers: a RoPE base of their own)

    def rope_of(self, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cos, sin from what the model computed for the step (one pair here)."""
        return rope

    def visible(self, mask: torch.Tensor | None, cache: KVCache, T: int) -> torch.Tensor | None:
        """The keys each query row sees ([rows, S] or None: all of length + T): the causal mask here."""
        return mask

    def forward(self, x: torch.Tensor, rope: Any, mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x)
        cos, sin = self.rope_of(rope)
        v = v.transpose(1, 2)  # [B, H_kv, T, D]
        q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, H, T, D]
        k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, H_kv, T, D]
        mask = self.visible(mask, cache, T)
        span = mask.shape[-1] if mask is not None else cache.length + T
        keys, values = cache.update(self.layer, k, v, span)  # [B, H_kv, S, D]
        rows = mask.shape[0] if mask is not None else T  # > T: queries padded to the fixed shape
        if rows > T:
            q = F.pad(q, (0, 0, 0, rows - T))  # [B, H, rows, D]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale,
                                             enable_gqa=self.n_kv != self.n_heads)
        out = out[:, :, :T]  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    activation = "silu"  # act(gate) * up: SwiGLU

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

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

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None, cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def attention_mask(cache: KVCache, T: int) -> torch.Tensor | None:
    """Which keys each query row of a T-token step sees ([rows, S], True = attend), or None for one token
    attending over length + 1 keys. Up to FIXED_ROWS tokens: FIXED_ROWS rows over the whole buffer (one shape
    for every decode and verify step of a cache); more (prefill): T rows over length + T keys."""
    fixed = T <= FIXED_ROWS and cache.length + FIXED_ROWS <= cache.max_len
    if T == 1 and not fixed:
        return None
    query_positions = cache.positions(FIXED_ROWS if fixed else T)  # [rows]
    keys = torch.arange(cache.max_len if fixed else cache.length + T, device=query_positions.device)  # [S]
    return keys[None, :] <= query_positions[:, None]  # [rows, S]


class Layers(nn.ModuleList):
    """The decoder layers, run one after another; appends the step's T tokens to the cache."""

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache) -> torch.Tensor:
        mask = attention_mask(cache, x.shape[1])
        for layer in self:
            x = layer(x, rope, mask, cache)
        cache.advance(x.shape[1])
        return x


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, layer: type[nn.Module] = DecoderLayer, norm: type[nn.Module] = RMSNorm,
                 embedding: type[nn.Module] = Embedding) -> None:
        super().__init__()
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = Layers(layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = norm(config.hidden_size, config.rms_norm_eps)


class Rows(Protocol):
    """What forward_steps reads of a step: the tokens to append to a cache, whether only the last is scored, and
    for a draft tree the parent row of each token (-1 for the first; empty: a chain, each token after the one
    before). A tree's token at depth d (d ancestors in the step) takes position length + d and attends to the
    cache and its ancestors; its keys are written at length + its row (KVCache.keep moves the accepted ones)."""

    tokens: list[int]
    cache: KVCache
    last_only: bool
    tree: tuple[int, ...]


class Tokens(NamedTuple):
    tokens: list[int]
    cache: KVCache
    last_only: bool = False
    tree: tuple[int, ...] = ()


class Transformer(nn.Module):
    """Decoder-only LM. `forward(input_ids, cache)` appends to the cache and returns float32 logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = self.backbone(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.plan = ON_TORCH  # how forwards run: quasar.kernels.plan.prepare_ decides it once, at load
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def backbone(self, config: ModelConfig) -> nn.Module:
        return Backbone(config)

    def reset_rope(self) -> None:
        """Compute the RoPE frequencies (again): a model built on the meta device gets them on the CPU here."""
        self.inv_freq = rope_inv_freq(self.config)

    @property
    def dtype(self) -> torch.dtype:
        """The activation (and KV cache) dtype; the embedding table may be stored narrower (bf16)."""
        return self.model.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return KVCache(self.config, max_len, batch, self.dtype, self.device)

    def rope_values(self, positions: torch.Tensor, inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions [T] (with the model's frequencies unless given), computed in float32 like
        the reference."""
        return rope_values(positions, self.inv_freq if inv_freq is None else inv_freq, self.dtype)

    def rope_table(self, n: int, freqs: str = "inv_freq") -> tuple[torch.Tensor, torch.Tensor]:
        """rope_values of positions 0 .. at least n - 1, [L, D] each, with the frequencies the attribute `freqs`
        holds (Gemma's sliding layers have their own), computed once and grown in powers of two: a step reads its
        rows instead of six tensor operations per forward (each one slow right after a forward has streamed the
        weights through the caches). Every value is computed by the same elementwise operations as rope_values, so
        the rows are the same floats (tested)."""
        inv_freq = getattr(self, freqs)
        tables = self.__dict__.setdefault("_rope_tables", {})  # freqs -> (cos, sin, the inv_freq they came from)
        table = tables.get(freqs)
        if table is None or table[2] is not inv_freq or table[0].shape[0] < n or table[0].dtype != self.dtype:
            size = max(256, 1 << (n - 1).bit_length())
            table = tables[freqs] = (*self.rope_values(torch.arange(size, device=inv_freq.device), inv_freq), inv_freq)
        return table[0], table[1]

    def rope(self, positions: torch.Tensor, freqs: str = "inv_freq") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] for positions [T] (rows of rope_table)."""
        cos, sin = self.rope_table(int(positions.max()) + 1 if positions.numel() else 1, freqs)
        return cos[positions], sin[positions]

    def rope_tables(self, n: int) -> list[torch.Tensor]:
        """The rope_table pairs the fused kernels take: cos, sin [L, D] (then a second pair where the model's
        sliding-window layers have frequencies of their own)."""
        return list(self.rope_table(n))

    def rope_span(self, start: int, n: int, freqs: str = "inv_freq") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, D] for positions start .. start + n - 1: contiguous views of rope_table."""
        cos, sin = self.rope_table(start + n, freqs)
        return cos[start:start + n], sin[start:start + n]

    def forward(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or [B, 1, V] with last_only), float32; appends to the cache. One
        sequence is a step (forward_steps); a batch of B equal-length rows sharing one cache runs on the modules."""
        if input_ids.shape[0] == 1:
            return self.forward_steps([Tokens(input_ids[0].tolist(), cache, last_only)])[0][None]
        return self.forward_modules(input_ids, cache, last_only)

    def forward_steps(self, steps: Sequence[Rows]) -> list[torch.Tensor]:
        """Several sequences' steps (distinct caches) -> each one's float32 logits [T, V] ([1, V] with last_only),
        bitwise what each gets alone; appends to every cache. How, the plan says: the whole forward in one kernel
        call (fused), every sequence's rows through one pass of the modules (batches_rows), or one pass each."""
        if any(s.tree for s in steps) and not self.plan.tree_rows:
            raise ValueError(f"draft trees need quasar's fused float32 kernels; this model runs on {self.plan.paths}")
        if not self.plan.fused and (not self.plan.batches_rows or len(steps) == 1):
            return [self.forward_modules(torch.tensor([s.tokens], device=self.device), s.cache, s.last_only)[0]
                    for s in steps]
        if any(s.cache.ring for s in steps):  # caches with rings (KVCache): one layout a call, max_rows tokens a step
            if any(s.tree for s in steps if s.cache.ring):
                raise ValueError("a draft tree needs a cache without rings")
            if not all(s.cache.ring for s in steps):
                return self.forward_by_layout(steps)
            if any(len(s.tokens) > s.cache.max_rows for s in steps):
                return self.forward_in_pieces(steps, steps[0].cache.max_rows)
        rows = [len(s.tokens) for s in steps]
        caches = [s.cache for s in steps]
        for cache, n in zip(caches, rows):
            cache.check_room(n)
        ends = list(itertools.accumulate(rows))
        scored = [range(end - 1 if s.last_only else end - n, end) for s, n, end in zip(steps, rows, ends)]
        picked = [i for r in scored for i in r]
        if self.plan.fused:  # the whole forward in one kernel call
            rope = self.rope_tables(max(c.length + n for c, n in zip(caches, rows)))  # cos, sin [L, D], ...
            ids = [t for s in steps for t in s.tokens]  # [N]
            trees = [list(s.tree) for s in steps] if any(s.tree for s in steps) else []
            logits = self.model.layers.logits(*self.model.embed_tokens.kernel_table(ids), rope, caches, rows, picked,
                                              trees)
        else:
            ids = torch.tensor([t for s in steps for t in s.tokens], device=self.device)  # [N]
            rope = self.rope(torch.cat([c.positions(n) for c, n in zip(caches, rows)]))  # cos, sin [N, D]
            x = self.model.embed_tokens(ids).to(self.dtype)  # [N, hidden]
            x = self.model.layers.forward_segments(x, rope, caches, rows)
            logits = self.lm_head(self.model.norm(x[torch.tensor(picked, device=self.device)])).float()  # [picked, V]
        return list(logits.split([len(r) for r in scored]))

    def forward_by_layout(self, steps: Sequence[Rows]) -> list[torch.Tensor]:
        """forward_steps of steps whose caches differ in layout (KVCache.ring: a long Gemma request's beside a short
        one's): one forward per layout, each step's logits in its place."""
        out: list[torch.Tensor | None] = [None] * len(steps)
        for ring in (False, True):
            group = [i for i, s in enumerate(steps) if bool(s.cache.ring) == ring]
            for i, logits in zip(group, self.forward_steps([steps[i] for i in group])):
                out[i] = logits
        return out  # type: ignore[return-value]

    def forward_in_pieces(self, steps: Sequence[Rows], most: int) -> list[torch.Tensor]:
        """forward_steps of steps some of which are longer than their caches take at once (`max_rows`, caches with
        rings): `most` tokens of each at a time, the logits of every piece joined (the last piece's, last_only)."""
        for s in steps:  # before any piece is written
            s.cache.check_room(len(s.tokens))
        done, parts = [0] * len(steps), [[] for _ in steps]
        while live := [i for i, s in enumerate(steps) if done[i] < len(s.tokens)]:
            pieces = [Tokens(steps[i].tokens[done[i]:done[i] + most], steps[i].cache, steps[i].last_only) for i in live]
            for i, piece, logits in zip(live, pieces, self.forward_steps(pieces)):
                parts[i].append(logits)
                done[i] += len(piece.tokens)
        return [torch.cat(p[-1:] if s.last_only else p) for p, s in zip(parts, steps)]

    def forward_modules(self, input_ids: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] through the modules one by one (each layer a module call, as hooks see them) -> logits
        [B, T, V] (or [B, 1, V]), float32; appends to the cache."""
        cache.check_room(input_ids.shape[1])
        rope = self.rope_span(cache.length, input_ids.shape[1])  # cos, sin [T, D]
        x = self.model.embed_tokens(input_ids).to(self.dtype)  # [B, T, hidden]
        x = self.model.layers(x, rope, cache)
        x = self.model.norm(x[:, -1:] if last_only else x)
        return self.lm_head(x).float()
