"""The vLLM hand-off: the `vllm serve` command line equivalent to a quasar server's settings.

vLLM is never imported: it lives in its own environment and is started as a separate program."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quasar.decoding.drafters.base import DrafterOptions
from quasar.spec import AUTO, NO_DRAFTER, EngineSpec


@dataclass(frozen=True)
class VllmServe:
    model_dir: Path  # a Hugging Face directory: float weights, or a compressed-tensors export for w8a8
    served_name: str
    dtype: str  # vLLM --dtype for the non-quantized parts: float32 | bfloat16
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_context: int | None = None
    executable: str = "vllm"


VLLM_K = 5  # vLLM's draft length is fixed; quasar's 'auto' maps to the paper's setting


def speculative_config(spec: EngineSpec, options: DrafterOptions) -> dict[str, object] | None:
    """quasar's drafter settings as vLLM's --speculative-config (prompt lookup = vLLM's 'ngram' method)."""
    if spec.drafter == NO_DRAFTER:
        return None
    if spec.drafter != "ngram":
        raise ValueError(f"the vLLM hand-off supports --drafter none or ngram, not {spec.drafter!r}")
    return {
        "method": "ngram",
        "num_speculative_tokens": VLLM_K if spec.k == AUTO else spec.k,
        "prompt_lookup_min": options.ngram_min,
        "prompt_lookup_max": options.ngram_max,
    }


def vllm_command(serve: VllmServe, spec: EngineSpec, options: DrafterOptions) -> list[str]:
    argv = [serve.executable, "serve", str(serve.model_dir), "--served-model-name", serve.served_name,
            "--dtype", serve.dtype, "--host", serve.host, "--port", str(serve.port)]
    if serve.max_context:
        argv += ["--max-model-len", str(serve.max_context)]
    if serve.api_key:
        argv += ["--api-key", serve.api_key]
    config = speculative_config(spec, options)
    if config is not None:
        argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return argv
