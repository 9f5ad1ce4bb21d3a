"""quasar: speculative decoding with a quantized (W8A8) verifier."""

__version__ = "0.1.0"

from quasar.api import LLM, RequestOutput  # noqa: E402
from quasar.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
