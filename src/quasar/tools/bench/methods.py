"""Benchmark methods: a registry from method names to things that answer a chat and say what it cost.

Names: quasar's engines by their EngineSpec (quasar.spec): 'ar:V' (plain decoding with verifier V: fp32, bf16,
w8a8, ...), 'DRAFTER+V' (speculative decoding, e.g. 'ngram+bf16', 'model:PATH+w8a8'; a cascade 'ngram+w8a8+bf16' or
'ar:w8a8+bf16', whose output is the last verifier's, see quasar.decoding.cascade), and peers 'hf:ar', 'hf:pld' (transformers bf16,
plain and with prompt_lookup_num_tokens), 'llamacpp:ar', 'llamacpp:pld' (llama-cpp-python, Q8_0;
append ':f16' for the F16 GGUF). Each distinct verifier is loaded once and shared between methods.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from quasar.builder import build_engine
from quasar.decoding.drafters.base import DrafterOptions
from quasar.decoding.engine import Engine
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.prompt import Messages
from quasar.decoding.sampling import SamplingParams
from quasar.registry import lookup
from quasar.spec import ENGINE_FORMS, EngineSpec, parse_k, parse_tree
from quasar.tools.bench.base import Method, PeerMissingError, Pool

log = logging.getLogger("quasar")

# peer kind -> "module:function" with build(name: str, pool: Pool) -> Method; every other name is quasar's own engine
PEERS: dict[str, str] = {
    "hf": "quasar.tools.bench.peers:build_hf",
    "llamacpp": "quasar.tools.bench.peers:build_llamacpp",
}
FORMS = f"{ENGINE_FORMS}, hf:ar, hf:pld, llamacpp:ar or llamacpp:pld"


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

    def forget(self) -> None:
        self.engine.caches.free.clear()


def engine_method(name: str, pool: Pool) -> Method:
    try:
        spec = EngineSpec.parse(name, k=parse_k(pool.options.k), tree=parse_tree(pool.options.tree))
    except ValueError as e:
        raise ValueError(f"unknown method {name!r} ({e}); choose from {FORMS}") from None
    options = DrafterOptions()
    return EngineMethod(name, build_engine(spec, pool.verifiers, options, pool.options.max_context))


def build_method(name: str, pool: Pool) -> Method:
    """A method name -> a ready Method (verifiers loaded through the pool)."""
    kind = name.partition(":")[0]
    if kind in PEERS:
        return lookup(PEERS, kind, "method", FORMS)(name, pool)
    return engine_method(name, pool)


def build_methods(names: list[str], pool: Pool) -> list[Method]:
    """Build every method; peers that are not installed are skipped with one line saying how to install them."""
    methods = []
    for name in names:
        try:
            methods.append(build_method(name, pool))
        except PeerMissingError as e:
            log.warning("skipping %s: %s", name, e)
    return methods
