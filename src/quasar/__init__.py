"""quasar: speculative decoding with a quantized (W8A8) verifier."""

__version__ = "0.1.0"
