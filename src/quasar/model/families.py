"""The model class of each family: the Llama family (model/llama.py) or Gemma 3 (model/gemma3.py)."""

from __future__ import annotations

from quasar.model.config import ModelConfig
from quasar.model.llama import Transformer


def model_for(config: ModelConfig) -> Transformer:
    """An (uninitialised, where built on the meta device) model of config's family."""
    if config.gemma:
        from quasar.model.gemma3 import Gemma3

        return Gemma3(config)
    return Transformer(config)
