"""quasar's AVX2 CPU kernels (csrc/: linears, attention, a whole decoder layer), compiled once on first use
into the quasar cache.

PyTorch's own int8 GEMM (`torch._int_mm`) has no fast path on x86 CPUs without AVX-512 VNNI (measured
here: 10-50x slower than a float32 GEMM), its bf16 GEMM none without AVX512-BF16, and its float kernels
round a row differently depending on how many rows come with it. These kernels stream the weights once
per call and compute every row of a result from its own input row only, so a verify step over k+1 rows
costs about one weight read and gives the rows that decoding the tokens one by one gives. The int8 dot
products pick the fastest instruction set at run time (`kernel().int8_paths()`: AVX-512 VNNI where the
CPU has it, else AVX2); all paths give the same int32 results. This module is
the one switch for device-specific code: `kernel()` returns None where the kernels cannot be used (no
AVX2, no C++ compiler), and every caller then falls back to plain torch (the path CUDA takes).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from quasar.files import cache_root
from quasar.progress import timed

log = logging.getLogger("quasar")
CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
# No FMA contraction: the rescale must round exactly like the torch reference (a * x_scale * w_scale).
# OpenMP: at::parallel_for in an extension runs serially unless the extension itself is built with it.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
COMPILE_S = 75  # a first compile on 2 cores (measured 73 s), for the progress bar's estimate


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


    inputs = b"".join(p.read_bytes() for p in sorted(CSRC.glob("*.[ch]*"))) + " ".join(CFLAGS + LDFLAGS + [torch.__version__]).encode()
    digest = hashlib.sha256(inputs).hexdigest()[:16]
    build = cache_root() / "kernels" / f"cpu-{digest}"
    build.mkdir(parents=True, exist_ok=True)
    fresh = not any(build.glob("*.so"))
    if fresh:
        log.warning("compiling quasar's AVX2 CPU kernels once (a minute or two) into %s", build)
    try:
        with timed("compiling quasar's CPU kernels", COMPILE_S) if fresh else nullcontext():
            return load(
                name=f"quasar_cpu_{digest}",
                sources=[str(p) for p in SOURCES],
                build_directory=str(build),
                extra_cflags=CFLAGS,
                extra_ldflags=LDFLAGS,
                verbose=False,
            )
    except Exception as e:  # no compiler, no ninja, ...: fall back to torch's kernels
        log.warning("quasar's AVX2 CPU kernels could not be built (%s); falling back to plain torch (slower)", e)
        return None
