"""The float verifiers: 'fp32' (the model's float32 weights) and 'bf16'."""

from __future__ import annotations

from quasar.model.loading import LoadedModel, load
from quasar.model.source import ModelSource
from quasar.spec import VerifierSpec


def load_fp32(model: ModelSource, spec: VerifierSpec | None = None, owned: bool = True) -> LoadedModel:
    return load(model, "fp32")


def load_bf16(model: ModelSource, spec: VerifierSpec | None = None, owned: bool = True) -> LoadedModel:
    """bf16 weights, every linear's input rounded to bf16, float32 sums, norms, attention and KV cache (as
    llama.cpp runs BF16 GGUFs): vdpbf16ps on CPUs with AVX512-BF16, the same floats from AVX2 elsewhere."""
    from quasar.quant.bf16 import float32_activations_, use_bf16_linears_

    loaded = load(model, "bf16")
    use_bf16_linears_(loaded.model, bf16_inputs=True)  # shares the bf16 weights
    float32_activations_(loaded.model)
    return loaded
