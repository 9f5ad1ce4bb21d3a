"""Benchmark methods: a registry from method names to things that answer a chat and say what it cost.

Names: 'ar:V' (plain decoding with verifier V: fp32, bf16, w8a8, ...), 'DRAFTER+V' (speculative
decoding, e.g. 'ngram+bf16', 'model:PATH+w8a8'; a cascade 'ngram+w8a8+bf16' or 'ar:w8a8+bf16', whose output
is the last verifier's, see quasar.decoding.cascade), and peers 'hf:ar', 'hf:pld' (transformers bf16,
plain and with prompt_lookup_num_tokens), 'llamacpp:ar', 'llamacpp:pld' (llama-cpp-python, Q8_0;
append ':f16' for the F16 GGUF). Each distinct verifier is loaded once and shared between methods.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from quasar.api import DecodeConfig, build_decoder, cascade_levels, verifier_path
from quasar.tools.bench.base import Method, PeerMissingError, Pool
from quasar.decoding.engine import Engine
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.prompt import Messages
from quasar.registry import lookup
from quasar.decoding.sampling import SamplingParams

log = logging.getLogger("quasar")

# method kind -> "module:function" with build(name: str, pool: Pool) -> Method; 'DRAFTER+V' names are of kind '+'
METHODS: dict[str, str] = {
    "ar": "quasar.tools.bench.methods:build_ar",
    "+": "quasar.tools.bench.methods:build_speculative",
    "hf": "quasar.tools.bench.peers:build_hf",
    "llamacpp": "quasar.tools.bench.peers:build_llamacpp",
}
FORMS = "ar:V, DRAFTER+V, hf:ar, hf:pld, llamacpp:ar or llamacpp:pld"


@dataclass
class EngineMethod:
    """Quasar itself: plain or speculative decoding through the Engine."""

    name: str
    engine: Engine

    @property
    def path(self) -> str:
        """The engine's kernel paths (both levels of a cascade)."""
        return self.engine.path

    def generate(self, messages: Messages, params: SamplingParams) -> RequestOutput:
        conversation = list(messages)  # the caller goes on appending turns to its list
        return self.engine.generate(self.engine.encode(conversation), params, conversation)


def build_ar(name: str, pool: Pool) -> Method:
    verifier = name.partition(":")[2]
    if not verifier:
        raise ValueError(f"method {name!r} needs a verifier, e.g. 'ar:bf16'")
    return engine_method(name, "none", verifier, pool)


def build_speculative(name: str, pool: Pool) -> Method:
    drafter, _, verifier = name.partition("+")  # 'ngram+w8a8'; a cascade: 'ngram+w8a8+bf16'
    if drafter == "none":
        raise ValueError(f"method {name!r} has no drafter; use 'ar:{verifier}' for plain decoding")
    return engine_method(name, drafter, verifier, pool)


def engine_method(name: str, drafter: str, verifier: str, pool: Pool) -> Method:
    middle_name, top = cascade_levels(verifier)
    target = pool.verifier(top)
    middle = None if middle_name is None else pool.verifier(middle_name)
    decode = DecodeConfig(drafter, pool.options.k)
    decoder = build_decoder(target, decode, pool.options.cache_dir, middle)
    engine = Engine(target, decoder=decoder, max_context=pool.options.max_context, path=verifier_path(target, middle))
    return EngineMethod(name, engine)


def build_method(name: str, pool: Pool) -> Method:
    """A method name -> a ready Method (verifiers loaded through the pool)."""
    kind = name.partition(":")[0]
    if kind not in METHODS and "+" in name:
        kind = "+"
    return lookup(METHODS, kind, "method", FORMS)(name, pool)


def build_methods(names: list[str], pool: Pool) -> list[Method]:
    """Build every method; peers that are not installed are skipped with one line saying how to install them."""
    methods = []
    for name in names:
        try:
            methods.append(build_method(name, pool))
        except PeerMissingError as e:
            log.warning("skipping %s: %s", name, e)
    return methods
