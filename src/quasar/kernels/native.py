"""quasar's AVX2 CPU kernels (csrc/: linears, attention, a whole decoder layer), compiled once on first use
into the quasar cache.

PyTorch's own int8 GEMM (`torch._int_mm`) has no fast path on x86 CPUs without AVX-512 VNNI (many times
slower than a float32 GEMM: docs/kernels.md), its bf16 GEMM none without AVX512-BF16, and its float kernels
round a row differently depending on how many rows come with it. These kernels stream the weights once
per call and compute every row of a result from its own input row only, so a verify step over k+1 rows
costs about one weight read and gives the rows that decoding the tokens one by one gives. The int8 dot
products pick the fastest instruction set at run time (`kernel().int8_paths()`: AVX-512 VNNI where the
CPU has it, else AVX2); all paths give the same int32 results. `kernel()` returns None where the kernels cannot be used, and quasar.kernels.plan (the one switch for
device-specific code) then keeps models on plain torch (the path CUDA takes). Two cases are told apart:
this machine *cannot* build them (no AVX2, no C++ compiler), which is normal; and the build *failed* where
it should work, which is a defect: the compiler's error is logged once and kept in `status()`, and the
test session fails on it instead of skipping the kernel tests.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from quasar.files import cache_root
from quasar.progress import polled

log = logging.getLogger("quasar")
CSRC = Path(__file__).parent / "csrc"
# One folder an operation (csrc/blocks, csrc/int8, ...), one file an instruction set where an operation has several;
# every folder is on the include path, so a file includes its neighbours' headers by name alone. The binding file
# first: it alone includes torch's extension headers (most of the build's time), so ninja starts it while the other
# core works through the kernel files.
SOURCES = sorted(CSRC.rglob("*.cpp"), key=lambda p: (p.name != "bindings.cpp", p.name))
INCLUDES = sorted({p.parent for p in CSRC.rglob("*.h")})
# No FMA contraction: the rescale must round exactly like the torch reference (a * x_scale * w_scale).
# OpenMP: at::parallel_for in an extension runs serially unless the extension itself is built with it.
# F16C: the W4A8 kernels widen their float16 block scales (every AVX2 CPU has it).
CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


@dataclass(frozen=True)
class KernelStatus:
    state: str  # 'loaded', 'cannot' (this machine cannot build them: normal) or 'failed' (a defect)
    reason: str  # the build directory, why not, or the build error

    def __str__(self) -> str:
        return f"{self.state}: {self.reason}"


_status: KernelStatus | None = None
_module: Any | None = None


def cpu_has_avx2() -> bool:
    try:
        return "avx2" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def cpu_name() -> str:
    """The CPU's model name as Linux reports it (platform.processor() elsewhere, often just the architecture)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def compiler() -> str | None:
    """The C++ compiler torch.utils.cpp_extension would call, if it exists."""
    return shutil.which(os.environ.get("CXX", "c++"))


def cannot_build() -> str | None:
    """Why this machine cannot build the kernels, or None when it should be able to."""
    if not cpu_has_avx2():
        return "this CPU has no AVX2"
    if compiler() is None:
        return f"no C++ compiler ({os.environ.get('CXX', 'c++')} not found on PATH)"
    return None


def build_dir(sources: list[Path] | None = None) -> Path:
    """Where the kernels for these sources, flags and torch version are built: one directory per digest. The
    sources' paths count too: torch's build file names them, and two checkouts of the same sources sharing one
    directory would each find it stale and rebuild it whole, in turn."""
    sources = SOURCES if sources is None else sources
    headers = sorted(p for d in INCLUDES for p in d.glob("*.h"))
    inputs = b"".join(p.read_bytes() for p in sorted(sources) + headers)
    inputs += "\0".join(str(p.resolve()) for p in sorted(sources)).encode()
    inputs += " ".join(CFLAGS + LDFLAGS + [torch.__version__]).encode()
    return cache_root() / "kernels" / f"cpu-{hashlib.sha256(inputs).hexdigest()[:16]}"


@contextmanager
def build_lock(build: Path):
    """Hold an exclusive lock on build/ while compiling. torch's own lock file (build/lock) outlives a
    compile that was killed, and later runs would wait on it forever; holding our lock (released by the
    OS when its holder dies) proves nobody is compiling, so a torch lock found then is stale."""
    build.mkdir(parents=True, exist_ok=True)
    with open(build / ".quasar-build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build / "lock"
        if stale.exists():
            log.warning("removing a stale build lock left by an interrupted compile: %s", stale)
            stale.unlink(missing_ok=True)
        yield


def build(directory: Path, sources: list[Path] = SOURCES) -> Any:
    """Compile sources in directory (once: later calls load the cached .so) and import them; raises on failure."""
    from torch.utils.cpp_extension import load

    with build_lock(directory):
        fresh = not any(directory.glob("*.so"))
        if fresh:
            log.warning("compiling quasar's CPU kernels once (about a minute) into %s", directory)
        with compile_progress(directory, sources) if fresh else nullcontext():
            return load(
                name=f"quasar_{directory.name.replace('-', '_')}",
                sources=[str(p) for p in sources],
                build_directory=str(directory),
                extra_include_paths=[str(p) for p in INCLUDES],
                extra_cflags=list(CFLAGS),  # copies: torch appends its libraries to the list it is given, which
                extra_ldflags=list(LDFLAGS),  # changed build_dir()'s digest for the rest of the process
                verbose=False,
            )


def compile_progress(directory: Path, sources: list[Path]):
    """A bar (or a line every few seconds in a log) counting the object files the compile has written."""
    start = time.time()

    def written() -> int:
        return sum(1 for o in directory.glob("*.o") if o.stat().st_mtime >= start - 1)

    return polled("compiling quasar's CPU kernels", len(sources), written, unit="files")


def try_build(sources: list[Path] = SOURCES) -> tuple[Any | None, KernelStatus]:
    """(module, status): the module where it built, else None with the reason it cannot or the build error."""
    directory = build_dir(sources)
    reason = cannot_build()
    if reason is not None and not (cpu_has_avx2() and any(directory.glob("*.so"))):  # a finished build needs no compiler
        return None, KernelStatus("cannot", reason)
    try:
        return build(directory, sources), KernelStatus("loaded", str(directory))
    except Exception as e:  # compiler errors surface as RuntimeError, OSError, ImportError, ...
        return None, KernelStatus("failed", f"{type(e).__name__}: {e}")


# The kernel paths a process may be told to take instead of the fastest its CPU has (`int8_paths()`,
# `float_paths()`): to run what another CPU kind runs, or to reproduce one path's floats on a CPU with several
# (bf16 on AMX tiles sums to other floats than vdpbf16ps). Read once, when the kernels load.
PATH_VARIABLES = {"QUASAR_INT8_PATH": "use_int8_path", "QUASAR_FLOAT_PATH": "use_float_path"}


def take_forced_paths(module: Any) -> None:
    """Put the module on the paths PATH_VARIABLES name; ValueError (one line) for a path this CPU lacks."""
    for variable, use in PATH_VARIABLES.items():
        name = os.environ.get(variable)
        if not name:
            continue
        try:
            getattr(module, use)(name)
        except RuntimeError as e:
            raise ValueError(f"{variable}={name}: {str(e).splitlines()[0]}") from None
        log.info("%s=%s: quasar's kernels take that path", variable, name)


_loading = threading.Lock()  # one build per process, whichever thread asks first (compile_ahead's or the model's)


def compile_ahead() -> None:
    """Start the one-time compile in a background thread where it has yet to run, so that it overlaps what a
    first command does before it needs the kernels (downloads, the GGUF conversion, calibration), which
    leaves a core idle much of the time. kernel() then waits for it."""
    if _status is None and cannot_build() is None and not any(build_dir().glob("*.so")):
        threading.Thread(target=_compile_in_background, name="quasar-kernel-compile", daemon=True).start()


def _compile_in_background() -> None:
    try:
        kernel()
    except Exception:  # noqa: BLE001 - a path QUASAR_INT8_PATH names that this CPU lacks: the main thread's own
        pass  # kernel() call raises it again, where it is reported


def kernel() -> Any | None:
    """The compiled extension module, or None where it cannot be used (see status()). Built on first call,
    into the cache's kernels/ folder (quasar.files.cache_root); one build per process. It runs on the fastest
    paths the CPU has, or on those QUASAR_INT8_PATH / QUASAR_FLOAT_PATH name (ValueError if the CPU lacks one)."""
    global _status, _module
    with _loading:
        if _status is None:
            module, status = try_build()
            if status.state == "failed":
                log.error("quasar's CPU kernels failed to build; running on plain torch (much slower): %s",
                          status.reason)
            if module is not None:
                take_forced_paths(module)
            elif forced := [f"{v}={os.environ[v]}" for v in PATH_VARIABLES if os.environ.get(v)]:
                log.warning("%s: no effect, quasar's kernels are not loaded (%s)", ", ".join(forced), status)
            _module, _status = module, status
        return _module


def release_memory() -> int:
    """Give memory kept for reuse back to the system (a server gone idle): the kernels' kept result blocks, then
    glibc's free pages (malloc_trim). Returns the bytes the kernels held (0 where they are not loaded)."""
    released = _module.release_results() if _module is not None else 0
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return released


def loaded() -> Any | None:
    """The extension module if a model has already built or loaded it in this process, else None (never builds:
    for helpers such as backends.argmax_rows that take the kernels only where a model already runs on them)."""
    return _module


def status() -> KernelStatus:
    """Whether the kernels are loaded, cannot be built here, or failed to build (with the error)."""
    kernel()
    assert _status is not None
    return _status
