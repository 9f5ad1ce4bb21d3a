"""The memory wall, measured: a read-bandwidth probe and verify-forward time vs number of scored tokens.

At batch 1 a verify forward reads every weight once, so its time is about bytes_read / bandwidth
whatever the number of scored tokens k+1 (docs/metrics.md). The probe reads a buffer far larger than the
last-level cache (a plain sum), so it measures memory, not cache. For the same reason each timed forward
starts cold: a sweep of the probe's size first pushes the last forward's weights out of the caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from quasar.model.llama import Transformer

PROBE_BYTES = 512 << 20  # 512 MiB, well past a 32 MB L3
SCORED_TOKENS = (1, 2, 4, 6, 8, 16)


def read_bandwidth(nbytes: int = PROBE_BYTES, repeats: int = 5) -> float:
    """Best-of-`repeats` sequential read bandwidth in bytes/s (sum of a float32 buffer of nbytes; an int32
    sum would widen to int64 and measure arithmetic, not memory)."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # [nbytes / 4]
    buffer.sum()  # touch every page once
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def cache_sweep(nbytes: int = PROBE_BYTES) -> Callable[[], None]:
    """A call that reads nbytes of its own buffer, so that the forward timed after it reads its weights from
    memory, as bytes / bandwidth assumes, whatever ran before it. Without it a forward that follows another of
    the same model finds part of its weights in the last-level cache: on an Intel Xeon VM with a large shared L3
    (reads of 100 MB at ~50 GB/s, of 500 MB at 23 GB/s) one row of the default model's w8a8 forward took 4.8 ms
    back to back, 7.1 ms after a 5 ms pause and 8.2 ms after 20 ms, so a figure depended on what ran before it."""
    buffer = torch.ones(nbytes // 4, dtype=torch.float32)  # [nbytes / 4]

    def sweep() -> None:
        buffer.sum()

    return sweep


def bytes_per_forward(model: torch.nn.Module) -> int:
    """Bytes of weights a decode forward reads: every parameter and buffer once (shared ones once), except an
    untied input embedding, of which it reads only the rows of the input tokens. A linear whose kernel keeps a
    packed copy (`kernel_weight`: a GGUF-block linear's panels and block scales, a W8A8 linear's panels) reads
    that copy and its bias, not its plain weights."""
    table = model.model.embed_tokens if hasattr(model, "model") else None
    embedding = getattr(table, "weight", None)
    tied = embedding is not None and getattr(getattr(model, "lm_head", None), "weight", None) is embedding
    lookups = set() if table is None or tied else {id(t) for t in list(table.parameters()) + list(table.buffers())}
    read = []
    for module in model.modules():
        packed = getattr(module, "kernel_weight", None)
        if isinstance(packed, tuple):
            read += [*packed, getattr(module, "bias", None)]
        else:
            read += list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    seen, total = set(), 0
    for tensor in read:
        if tensor is None or tensor.data_ptr() in seen or id(tensor) in lookups:
            continue
        seen.add(tensor.data_ptr())
        total += tensor.numel() * tensor.element_size()
    return total


@torch.inference_mode()
def verify_forward_times(
    model: Transformer, context: int = 256, scored: Iterable[int] = SCORED_TOKENS, repeats: int = 3, cold: bool = True
) -> dict[int, float]:
    """Median seconds of one forward scoring n tokens after `context` cached tokens, for each n; cold: each
    forward after a cache_sweep(), False: back to back."""
    sizes = list(scored)
    sweep = cache_sweep() if cold else lambda: None
    cache = model.new_cache(context + max(sizes) + 1)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device=model.device)  # [1, S]
    model(prompt, cache, last_only=True)
    out = {}
    for n in sizes:
        ids = torch.randint(0, model.config.vocab_size, (1, n), device=model.device)  # [1, k+1]
        times = []
        for _ in range(repeats + 1):  # the first one warms up
            sweep()
            start = time.perf_counter()
            model(ids, cache)
            times.append(time.perf_counter() - start)
            cache.trim(n)
        out[n] = sorted(times[1:])[len(times[1:]) // 2]
    return out
