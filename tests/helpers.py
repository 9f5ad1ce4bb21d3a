"""What many tests share: engines and decoders by name, the CLI as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from quasar.builder import Verifiers, build_decoder, build_engine
from quasar.decoding.autoregressive import Steps
from quasar.decoding.engine import Decoder, Engine
from quasar.files import cache_root, use_cache_dir
from quasar.decoding.step import Step, run_steps
from quasar.model.llama import Transformer
from quasar.model.loading import LoadedModel
from quasar.spec import AUTO, EngineSpec, VerifierSpec


def default_source():  # -> ModelSource
    """The embedded default model's source, as `--model default` names it."""
    from quasar.builder import model_source

    return model_source("default")


def engine_for(name: str, model: str = "default", k: int | str = AUTO, guard: float | None = None) -> Engine:
    """The engine an EngineSpec name gives ('ngram+w8a8', 'ar:bf16', 'ngram+w8a8+bf16', ...)."""
    return build_engine(EngineSpec.parse(name, k=k, guard=guard), Verifiers(model))


def decoder_for(drafter: str, target: LoadedModel, k: int | str = AUTO, middle: LoadedModel | None = None) -> Decoder:
    """The decoder of `drafter` ('none', 'ngram', ...) for an already loaded target (and a cascade's middle)."""
    levels = (VerifierSpec("fp32"),) * (1 if middle is None else 2)  # the loaded models stand for the levels
    return build_decoder(EngineSpec(levels, drafter, k), target, middle=middle)


def share_kernels(cache: Path) -> Path:
    """A fresh cache folder whose kernels/ is the user cache's, so that nothing given it (this process or a
    subprocess's --cache-dir) compiles the kernels again (minutes on two cores)."""
    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    if not (cache / "kernels").exists():
        (cache / "kernels").symlink_to(kernels, target_is_directory=True)
    return cache


@contextmanager
def cache_at(path: Path) -> Iterator[Path]:
    """The process's cache folder set to a fresh `path` (share_kernels) for a block, then back to the one before."""
    previous = use_cache_dir(share_kernels(path))
    try:
        yield path
    finally:
        use_cache_dir(previous)


def assert_rows_alone(op, x: torch.Tensor, y: torch.Tensor | None = None, prefixes: bool = False) -> None:
    """op(x) [M, ...] (or the given y) equals, row by row and bit for bit, op of each row alone (and with
    prefixes, op of every first m rows): a row's result depends on its own input only."""
    y = op(x) if y is None else y
    for m in range(len(x)):
        assert torch.equal(op(x[m : m + 1])[0], y[m]), f"row {m} alone differs"
        if prefixes and m:
            assert torch.equal(op(x[:m]), y[:m]), f"the first {m} rows differ"


def run_cli(*args: str, stdin: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m quasar ARGS...`, its output captured as text."""
    return subprocess.run([sys.executable, "-m", "quasar", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, check=False)


@torch.inference_mode()
def drive(model: Transformer, steps: Steps) -> Iterator[list[int]]:
    """Run a decoder alone: each forward it asks for, at once; yields the token lists it emits."""
    logits = None
    while True:
        try:
            item = steps.send(logits)
        except StopIteration:
            return
        if isinstance(item, Step):
            logits = run_steps(model, [item])[0]
        else:
            logits = None
            yield item
