"""quasar: speculative decoding with a quantized (W8A8) verifier."""

__version__ = "0.1.0"

from quasar.api import LLM, RequestOutput
from quasar.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
