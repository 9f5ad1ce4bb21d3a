"""The AVX2 W8A8 kernel (csrc/w8a8_avx2.cpp), compiled once on first use into the quasar cache.

PyTorch's own int8 GEMM (`torch._int_mm`) has no fast path on x86 CPUs without AVX-512 VNNI: measured
here it is 10-50x slower than a float32 GEMM. The kernel streams int8 weights once per call and keeps the
per-token-quantized activations in cache, so a verify step over k+1 rows costs about one weight read.
`kernel()` returns None where it cannot be used (no AVX2, no C++ compiler); callers then fall back.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("quasar")
SOURCE = Path(__file__).parent / "csrc" / "w8a8_avx2.cpp"
# No FMA contraction: the rescale must round exactly like the torch reference (a * x_scale * w_scale).
CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off"]


def cpu_has_avx2() -> bool:
    try:
        return "avx2" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


@functools.cache
def kernel() -> Any | None:
    """The compiled extension module, or None when this machine cannot build or run it."""
    if not cpu_has_avx2():
        return None
    from torch.utils.cpp_extension import load

    from quasar.loading import cache_root

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode() + torch.__version__.encode()).hexdigest()[:16]
    build = cache_root() / "kernels" / f"w8a8_avx2-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    if not any(build.glob("*.so")):
        log.warning("compiling the AVX2 int8 kernel once (about a minute) into %s", build)
    try:
        return load(
            name=f"quasar_w8a8_avx2_{digest}",
            sources=[str(SOURCE)],
            build_directory=str(build),
            extra_cflags=CFLAGS,
            verbose=False,
        )
    except Exception as e:  # no compiler, no ninja, ...: fall back to torch's kernels
        log.warning("the AVX2 int8 kernel could not be built (%s); falling back to torch._int_mm", e)
        return None
