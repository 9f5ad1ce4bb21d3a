"""quasar: speculative decoding with a quantized (W8A8) verifier.

    from quasar import LLM, SamplingParams

The names are imported on first use (PEP 562), so `quasar --help` and the leaf modules do not load torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from quasar.version import __version__

EXPORTS = {"LLM": "quasar.api", "RequestOutput": "quasar.decoding.outputs", "SamplingParams": "quasar.decoding.sampling"}
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name not in EXPORTS:
        raise AttributeError(f"module 'quasar' has no attribute {name!r}")
    return getattr(importlib.import_module(EXPORTS[name]), name)
