"""Static key/value cache: preallocated buffers, rollback is a counter move."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from quasar.model.config import ModelConfig


class ContextOverflowError(ValueError):
    """More tokens than the cache (context window) holds."""


def common_prefix(held: list[int], tokens: list[int], limit: int) -> int:
    """How many first tokens of `held` and `tokens` agree, at most `limit` (<= both lengths)."""
    common = limit if held[:limit] == tokens[:limit] else 0  # the usual case: one comparison in C
    while common < limit and held[common] == tokens[common]:
        common += 1
    return common


def blank(*shape: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A buffer left unwritten: the memory of a large one becomes resident only as its pages are written."""
    return torch.empty(shape, dtype=dtype, device=device)


def window_reach(window: int) -> int:
    """How many positions before a step's first one a sliding-window layer reads: its first row's window (window - 1),
    from the start of that key's block of 32 (csrc/attention/attention.cpp: up to 31 more)."""
    return window - 1 + 31


def ring_size(window: int, rows: int) -> int:
    """R of a ring that holds what steps of up to `rows` tokens read on a layer of this window (their keys and the
    window_reach before them), in whole blocks of 32."""
    return (window_reach(window) + rows + 31) // 32 * 32


class KVCache:
    """K/V buffers of shape [L, B, H_kv, S, D]; `length` tokens of them are valid.

    The model writes new keys at [length, length + T) in every layer, then calls
    `advance(T)`. Speculative decoding drops rejected positions with `trim(n)`.
    The buffers start unwritten, so a cache sized for the whole context costs memory only for the positions it
    uses: positions are written before they are read, except those past the end that a masked step reads
    (`update` zeroes them first).

    With `ring` (R > 0; the fused kernels only), the sliding-window layers keep their keys in rings `ring_k`,
    `ring_v` [L_sliding, B, H_kv, 2 R, D] (position p in slots p % R and p % R + R, csrc/attention/attention.cpp) and `k`, `v`
    hold the other layers only: a long context costs those layers nothing past the window. Steps then take at most
    `max_rows` tokens, and a trim may go back at most as far as the rings still hold the window (`keeps`).
    """

    def __init__(
        self,
        config: ModelConfig,
        max_len: int,
        batch: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ring_rows: int = 0,
    ) -> None:
        """ring_rows > 0: keep a sliding-window model's window layers in rings for steps of at most that many rows."""
        sliding = sum(config.sliding_layers) if ring_rows and config.sliding_window else 0
        self.ring = ring_size(config.sliding_window, ring_rows) if sliding else 0
        self.reach = window_reach(config.sliding_window) if sliding else 0
        self.max_rows = ring_rows if sliding else None  # the most tokens a step may write (None: any)
        H, D = config.num_key_value_heads, config.head_dim
        shape = (config.num_hidden_layers - sliding, batch, H, max_len, D)
        self.k = blank(*shape, dtype=dtype, device=device)  # [L, B, H_kv, S, D]
        self.v = blank(*shape, dtype=dtype, device=device)  # [L, B, H_kv, S, D]
        if sliding:
            self.ring_k = blank(sliding, batch, H, 2 * self.ring, D, dtype=dtype, device=device)
            self.ring_v = blank(sliding, batch, H, 2 * self.ring, D, dtype=dtype, device=device)
        self.finite = [0] * config.num_hidden_layers  # per layer: positions below it were written or zeroed
        self.max_len = max_len
        self.length = 0
        self.written = 0  # the end of the positions written since the last reset (past `length` after a trim)
        self.held: list[int] = []  # the tokens at positions [0, len(held)), where known (len(held) <= length)

    def check_room(self, n: int) -> None:
        """Refuse n more tokens where they do not fit the context window."""
        if self.length + n > self.max_len:
            raise ContextOverflowError(
                f"{self.length + n} tokens do not fit the context window of {self.max_len}"
            )

    def positions(self, n: int) -> torch.Tensor:
        """Positions of the next n tokens: [n]."""
        self.check_room(n)
        return torch.arange(self.length, self.length + n, device=self.k.device)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, span: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, T, D] at the next T positions; return the first `span` keys/values
        [B, H_kv, span, D] (span >= length + T; positions past that are masked by the caller)."""
        if self.ring:
            raise RuntimeError("a cache with rings is read by the fused kernels only")
        end = self.length + k.shape[2]
        self.k[layer, :, :, self.length : end] = k
        self.v[layer, :, :, self.length : end] = v
        unread = max(end, self.finite[layer])  # masked positions past it: made finite, so a zero weight keeps them out
        if span > unread:
            self.k[layer, :, :, unread:span] = 0
            self.v[layer, :, :, unread:span] = 0
            self.finite[layer] = span
        return self.k[layer, :, :, :span], self.v[layer, :, :, :span]

    def advance(self, n: int) -> None:
        self.length += n
        self.written = max(self.written, self.length)

    def keeps(self, n: int) -> bool:
        """Whether this cache trimmed to its first n positions still holds what the next step reads: always, but
        where the rings have since overwritten the window of position n."""
        return not self.ring or self.written - n <= self.ring - self.reach

    def wrote(self, n: int, tokens: list[int] | None = None) -> None:
        """Record that the last forward wrote n positions before `length`, holding `tokens` (None: not known, or not
        one sequence's): quasar.decoding.step.run_steps calls it, so that a cache pool can hand a later prompt what it
        shares with them."""
        start = self.length - n
        del self.held[start:]
        if tokens is not None and len(self.held) == start:
            self.held.extend(tokens)

    def copy_prefix(self, source: KVCache, n: int) -> None:
        """Hold the first n positions of `source` (a cache of the same model and layout, `source.keeps(n)`), keys,
        values and tokens."""
        if not source.keeps(n) or source.ring != self.ring:
            raise ValueError(f"cannot take {n} positions of a cache whose rings no longer hold them")
        self.k[:, :, :, :n] = source.k[:, :, :, :n]
        self.v[:, :, :, :n] = source.v[:, :, :, :n]
        if self.ring:
            self.ring_k.copy_(source.ring_k)
            self.ring_v.copy_(source.ring_v)
        self.length, self.written, self.held = n, source.written, source.held[:n]

    def trim(self, n: int) -> None:
        """Forget the last n positions (they are overwritten by the next write)."""
        if not 0 <= n <= self.length or not self.keeps(self.length - n):
            raise ValueError(f"cannot trim {n} of {self.length} cached positions")
        self.length -= n
        del self.held[self.length :]

    def keep(self, start: int, slots: list[int]) -> None:
        """After a draft tree's step (quasar.model.llama.Rows): hold positions [0, start), then the keys and values
        of `slots` (ascending, each >= start: the accepted path's rows) at start, start + 1, ...; forget the rest. A
        path's token at depth d was rotated for position start + d, the place it moves to."""
        if any(s < start + i for i, s in enumerate(slots)) or sorted(slots) != slots or start + len(slots) > self.length:
            raise ValueError(f"cannot keep slots {slots} from position {start} of {self.length}")
        if self.ring:
            raise ValueError("a cache with rings holds no draft trees")
        source = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        self.k[:, :, :, start:start + len(slots)] = self.k[:, :, :, source]
        self.v[:, :, :, start:start + len(slots)] = self.v[:, :, :, source]
        held = [self.held[s] for s in slots if s < len(self.held)]
        del self.held[start:]
        if len(held) == len(slots) and len(self.held) == start:
            self.held.extend(held)
        self.length = start + len(slots)

    def reset(self) -> None:
        self.length = self.written = 0
        self.held.clear()


class StreamCache:
    """A drafter's own KV cache that follows a token stream lazily: before a forward it is trimmed to the longest
    prefix it shares with the stream, and only the tokens after that prefix are fed (so the stream may be
    rolled back or rewritten freely between calls)."""

    def __init__(self, model: Any, initial_len: int = 1024) -> None:
        self.model = model  # anything with new_cache(max_len) -> KVCache
        self.initial_len = initial_len
        self.cache: KVCache | None = None
        self.cached: list[int] = []  # the tokens whose keys/values the cache holds

    def ready(self, needed: int) -> KVCache:
        """The cache, (re)allocated to hold at least `needed` positions."""
        if self.cache is None or self.cache.max_len < needed:
            self.cache = self.model.new_cache(max(needed * 2, self.initial_len))
            self.cached = []
        return self.cache

    def follow(self, stream: list[int], most: int | None = None) -> list[int]:
        """Trim the cache to its common prefix with `stream`; return the tokens still to feed (at least one, to
        get logits). More than `most` (a prompt, a long stretch) are prefilled here, without the lm_head, but
        the last. Call `fed` with what the next forward writes."""
        assert self.cache is not None
        common = common_prefix(self.cached, stream, min(len(self.cached), len(stream) - 1))
        if not self.cache.keeps(common):  # its rings no longer hold that prefix's window: start over
            common = 0
            self.cache.reset()
        self.cache.trim(self.cache.length - common)
        del self.cached[common:]
        feed = stream[common:]
        if most is not None and len(feed) > most:
            self.model(torch.tensor([feed[:-1]], device=self.model.device), self.cache, last_only=True)
            self.fed(feed[:-1])
            feed = feed[-1:]
        return feed

    def fed(self, tokens: list[int]) -> None:
        self.cached.extend(tokens)

    def trim(self, n: int) -> None:
        """Forget the last n cached positions."""
        assert self.cache is not None
        self.cache.trim(n)
        del self.cached[len(self.cached) - n :]


class CachePool:
    """The KV caches of the requests in flight: `take` one of a size, `give` it back when its request ends.
    Caches given back are kept for the next requests (at most `spare`). `budget` bounds the positions held
    (taken and kept; None: no bound): `fits(size)` says whether a request needing `size` may start now."""

    def __init__(self, model: Any, budget: int | None = None, spare: int = 1) -> None:
        self.model = model  # anything with new_cache(max_len) -> KVCache
        self.budget, self.spare = budget, spare
        self.free: list[KVCache] = []
        self.taken = 0  # positions in caches taken

    def fits(self, size: int) -> bool:
        return self.budget is None or self.taken + size <= self.budget

    def take(self, size: int, prompt: list[int] | None = None, in_use: Sequence[KVCache] = ()) -> KVCache:
        """A cache of `size` positions. With a prompt, on a model whose every row is computed from its own input
        alone (quasar's kernels: a position's keys and values are bitwise the same whether written by a prefill, a
        decode or a verify step), the cache already holds the longest start of the prompt (all of it but the last
        token) that a kept cache, or one of the caches `in_use` (copied, never taken), holds, as llama.cpp and
        vLLM's prefix caching do: a chat's next turn prefills only its new tokens. Its `length` says how many
        positions are filled."""
        source, common = self.longest_prefix(prompt or [], in_use)
        kept = source is not None and any(source is c for c in self.free)
        cache = source if kept and source.max_len == size else None  # type: ignore[union-attr]
        cache = cache or next((c for c in self.free if c.max_len == size), None)
        if cache is not None:
            self.free.remove(cache)
        else:
            while self.free and self.budget is not None and self.taken + size + self.kept > self.budget:
                self.free.pop(0)  # the oldest kept cache makes room
            cache = self.model.new_cache(size)
        if cache is source:
            cache.trim(cache.length - common)
        else:
            cache.reset()
            if common and cache.ring == source.ring:  # a prefix goes into a cache of its own layout only
                cache.copy_prefix(source, common)
        self.taken += size
        return cache

    def longest_prefix(self, prompt: list[int], in_use: Sequence[KVCache] = ()) -> tuple[KVCache | None, int]:
        """The kept cache (or cache `in_use`) holding the longest start of `prompt` (short of its last token), and
        that length."""
        if len(prompt) < 2 or not self.model.plan.batches_rows:
            return None, 0
        best, most = None, 0
        for cache in [*self.free, *in_use]:
            common = common_prefix(cache.held, prompt, min(len(cache.held), len(prompt) - 1))
            if common > most and cache.keeps(common):
                best, most = cache, common
        return best, most

    def give(self, cache: KVCache) -> None:
        self.taken -= cache.max_len
        self.free.append(cache)
        self.drop_extra()

    def configure(self, budget: int | None, spare: int) -> tuple[int | None, int]:
        """Set the budget and the spare caches kept (dropping the oldest beyond it); returns the old settings."""
        old = self.budget, self.spare
        self.budget, self.spare = budget, spare
        self.drop_extra()
        return old

    def drop_extra(self) -> None:
        del self.free[: max(0, len(self.free) - self.spare)]

    @property
    def kept(self) -> int:
        return sum(c.max_len for c in self.free)
