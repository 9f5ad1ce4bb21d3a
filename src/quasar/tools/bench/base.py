"""What every benchmark method shares: the Method protocol, the options methods are built from and the
Pool of loaded verifiers. The registry of method names is in methods.py, the peers in peers.py; both
import this module and neither imports the other."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from quasar.builder import Verifiers
from quasar.model.loading import LoadedModel, float_directory
from quasar.model.source import ModelSource
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.prompt import Messages
from quasar.decoding.sampling import SamplingParams
from quasar.spec import VerifierSpec

log = logging.getLogger("quasar")


class PeerMissingError(ValueError):
    """A peer implementation that is not installed; the message says how to install it."""


class Method(Protocol):
    """Answers a conversation. Its output's `stats.wall_s` is the seconds from the request to its last
    token, prompt processing included."""

    name: str
    path: str  # what runs it, printed beside its figures: quasar's kernel paths ('kernels:dpbusd'), or the peer's build

    def generate(self, messages: Messages, params: SamplingParams) -> RequestOutput: ...

    def forget(self) -> None:
        """Drop what earlier answers left for later ones to reuse (kept KV caches): a repeated prompt's rounds
        then all start alike."""


@dataclass(frozen=True)
class MethodOptions:
    model: str = "default"
    max_context: int | None = None
    k: int | str = "auto"  # draft length for DRAFTER+V: adaptive, as generate's; the paper used 5
    tree: int | str = 1  # candidates per position of DRAFTER+V's draft trees, as generate's (1: one chain)
    quantized: str | None = None  # a `quasar quantize` checkpoint for the w8a8 / w8a16 verifier
    pld_tokens: int = 10  # peers' prompt-lookup draft length (transformers' documented example)


@dataclass
class Pool:
    """The methods' options and the verifiers they load, each loaded once and shared by every method that verifies
    with it."""

    options: MethodOptions
    verifiers: Verifiers = field(init=False)

    def __post_init__(self) -> None:
        o = self.options
        self.verifiers = Verifiers(o.model, o.quantized)

    def verifier(self, spec: VerifierSpec | str) -> LoadedModel:
        return self.verifiers.get(VerifierSpec.parse(spec) if isinstance(spec, str) else spec)

    @property
    def source(self) -> ModelSource:
        return self.verifiers.model

    def directory(self) -> Path:
        """The model's float Hugging Face-style directory (GGUF sources are converted once, cached)."""
        return float_directory(self.source)
