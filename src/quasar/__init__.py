"""quasar: speculative decoding with a quantized (W8A8) verifier."""

from quasar.version import __version__
from quasar.api import LLM, RequestOutput
from quasar.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
