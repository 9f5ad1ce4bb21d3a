"""Benchmark methods: a registry from method names to things that answer a chat and say what it cost.

Names: 'ar:V' (plain decoding with verifier V: fp32, bf16, w8a8, ...), 'DRAFTER+V' (speculative
decoding, e.g. 'ngram+bf16', 'model:PATH+w8a8'), and peers 'hf:ar', 'hf:pld' (transformers bf16,
plain and with prompt_lookup_num_tokens), 'llamacpp:ar', 'llamacpp:pld' (llama-cpp-python, Q8_0;
append ':f16' for the F16 GGUF). Each distinct verifier is loaded once and shared between methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from quasar.engine import Engine
from quasar.loading import LoadedModel, gguf_directory, resolve, sha256_file
from quasar.sampling import SamplingParams
from quasar.stats import GenerationStats
from quasar.verifiers import load_verifier

log = logging.getLogger("quasar")
Messages = list[dict[str, str]]


class PeerMissingError(ValueError):
    """A peer implementation that is not installed; the message says how to install it."""


@dataclass
class Output:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    wall_time: float  # seconds from the request to its last token, prompt processing included


class Method(Protocol):
    name: str

    def generate(self, messages: Messages, params: SamplingParams) -> Output: ...


@dataclass(frozen=True)
class MethodOptions:
    model: str = "default"
    cache_dir: str | None = None
    max_context: int | None = None
    k: int | str = 5  # draft length for DRAFTER+V (the paper: 5)
    quantized: str | None = None  # a `quasar quantize` checkpoint for the w8a8 / w8a16 verifier
    pld_tokens: int = 10  # peers' prompt-lookup draft length (transformers' documented example)


def encode(tokenizer: Any, messages: Messages) -> list[int]:
    """Chat messages -> prompt ids with the chat template (plain concatenation when there is none)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode("\n\n".join(m["content"] for m in messages))


@dataclass
class Pool:
    """Loaded verifiers by name, shared by every method that verifies with them."""

    options: MethodOptions
    verifiers: dict[str, LoadedModel] = field(default_factory=dict)

    def verifier(self, name: str) -> LoadedModel:
        if name not in self.verifiers:
            log.info("loading verifier %s", name)
            quantized = self.options.quantized and name.split(":")[0] in ("w8a8", "w8a16")
            model = self.options.quantized if quantized else self.options.model
            self.verifiers[name] = load_verifier(model, name, self.options.cache_dir)
        return self.verifiers[name]

    def directory(self) -> Path:
        """The model's Hugging Face-style directory (GGUF sources are converted once, cached)."""
        path = resolve(self.options.model, self.options.cache_dir)
        return gguf_directory(path, sha256_file(path), self.options.cache_dir) if path.is_file() else path


@dataclass
class EngineMethod:
    """Quasar itself: plain or speculative decoding through the Engine."""

    name: str
    engine: Engine

    def generate(self, messages: Messages, params: SamplingParams) -> Output:
        ids = encode(self.engine.tokenizer, messages)
        start = time.perf_counter()
        completion = self.engine.generate(ids, params)
        wall = time.perf_counter() - start
        return Output(completion.text, completion.token_ids, completion.stats, wall)


def build_ar(name: str, pool: Pool) -> Method:
    verifier = name.partition(":")[2]
    if not verifier:
        raise ValueError(f"method {name!r} needs a verifier, e.g. 'ar:bf16'")
    return EngineMethod(name, Engine(pool.verifier(verifier), max_context=pool.options.max_context))


def build_speculative(name: str, pool: Pool) -> Method:
    drafter_spec, _, verifier = name.rpartition("+")
    try:
        from quasar.drafters import DrafterOptions, build_drafter
        from quasar.speculative import Speculative
    except ImportError as e:
        raise ValueError(f"method {name!r} needs speculative decoding (quasar.speculative, quasar.drafters): {e}") from e
    target = pool.verifier(verifier)
    drafter = build_drafter(drafter_spec, target, DrafterOptions(cache_dir=pool.options.cache_dir))
    if drafter is None:
        raise ValueError(f"method {name!r} has no drafter; use 'ar:{verifier}' for plain decoding")
    decoder = Speculative(drafter, pool.options.k)
    return EngineMethod(name, Engine(target, decoder=decoder, max_context=pool.options.max_context))


def build_hf(name: str, pool: Pool) -> Method:
    from quasar.bench.peers import HFMethod

    mode = name.partition(":")[2]
    if mode not in ("ar", "pld"):
        raise ValueError(f"unknown transformers peer {name!r}; choose hf:ar or hf:pld")
    return HFMethod(name, pool.directory(), pool.options.pld_tokens if mode == "pld" else None)


def build_llamacpp(name: str, pool: Pool) -> Method:
    from quasar.bench.peers import LlamaCppMethod

    _, mode, precision = (name.split(":") + ["q8_0"])[:3]
    if mode not in ("ar", "pld") or precision not in ("q8_0", "f16"):
        raise ValueError(f"unknown llama.cpp peer {name!r}; choose llamacpp:{{ar,pld}}[:f16|:q8_0]")
    return LlamaCppMethod(name, pool, precision, pool.options.pld_tokens if mode == "pld" else None)


BUILDERS: dict[str, Callable[[str, Pool], Method]] = {"ar": build_ar, "hf": build_hf, "llamacpp": build_llamacpp}


def build_method(name: str, pool: Pool) -> Method:
    """A method name -> a ready Method (verifiers loaded through the pool)."""
    if "+" in name:
        return build_speculative(name, pool)
    kind = name.partition(":")[0]
    if kind not in BUILDERS:
        raise ValueError(f"unknown method {name!r}; use ar:V, DRAFTER+V, hf:ar, hf:pld, llamacpp:ar or llamacpp:pld")
    return BUILDERS[kind](name, pool)


def build_methods(names: list[str], pool: Pool) -> list[Method]:
    """Build every method; peers that are not installed are skipped with one line saying how to install them."""
    methods = []
    for name in names:
        try:
            methods.append(build_method(name, pool))
        except PeerMissingError as e:
            log.warning("skipping %s: %s", name, e)
    return methods

