"""llama.cpp as a fidelity peer: the logits of its Q8_0 (int8 weights and activations, one scale per block
of 32) copy of the same weights, of its own Q4_K_M of them (`llamacpp:q4_k_m`), or of the model's own GGUF file
(`llamacpp:file`: the Q4_K_M or Q4_1 users run), on
the same token windows as quasar's verifiers (`quasar fidelity --peer llamacpp`). Needs llama-cpp-python and a GGUF
model; the Q8_0 copy is written once (bench/gguf_export.py).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import torch

from quasar.model.source import ModelSource

INSTALL = ("llama.cpp rows skipped: llama-cpp-python is not installed "
           "(pip install llama-cpp-python; it builds from source in about 12 minutes)")
PRECISIONS = ("q8_0", "q4_k_m", "file")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppScorer:
    """`logits(ids [1, T]) -> [1, T, V]` float32 from llama.cpp, the same windows quasar scores."""

    def __init__(self, model: ModelSource, precision: str, max_tokens: int) -> None:
        from llama_cpp import Llama

        from quasar.tools.bench.gguf_export import llama_cpp_gguf

        path = llama_cpp_gguf(model, precision)
        self.llm = Llama(str(path), n_ctx=max_tokens, n_batch=max_tokens, n_threads=torch.get_num_threads(),
                         logits_all=True, verbose=False)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        scores = np.asarray(self.llm.scores[: ids.shape[1]], dtype=np.float32)  # [T, V]
        return torch.from_numpy(scores.copy())[None]


def peers(names: list[str], model: ModelSource, max_tokens: int) -> dict[str, LlamaCppScorer]:
    """'llamacpp' (or 'llamacpp:q8_0') -> {'llama.cpp q8_0': scorer}; an empty dict with one line on stderr when
    llama-cpp-python is missing, or when it fails a probe run in a child process (bench.peers.llama_cpp_fails)."""
    import sys

    wanted = []
    for name in names:
        kind, _, precision = name.partition(":")
        if kind != "llamacpp" or (precision or "q8_0") not in PRECISIONS:
            raise ValueError(f"unknown fidelity peer {name!r}; choose from llamacpp, llamacpp:q8_0, llamacpp:q4_k_m, llamacpp:file")
        wanted.append(precision or "q8_0")
    if wanted and not available():
        print(INSTALL, file=sys.stderr)
        return {}
    from quasar.tools.bench.gguf_export import llama_cpp_gguf
    from quasar.tools.bench.peers import llama_cpp_fails

    scorers = {}
    for p in dict.fromkeys(wanted):
        if why := llama_cpp_fails(str(llama_cpp_gguf(model, p)), torch.get_num_threads()):
            print(f"skipping llama.cpp {p}: {why}", file=sys.stderr)
            continue
        scorers[f"llama.cpp {p}"] = LlamaCppScorer(model, p, max_tokens)
    return scorers
