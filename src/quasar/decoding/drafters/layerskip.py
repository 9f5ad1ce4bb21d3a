"""'layerskip:N': the verifier drafts for itself with only its first N layers (early exit, as in
LayerSkip, Elhoushi et al. 2024): layers 0..N-1, then the verifier's final norm and lm_head.

The weights are shared with the verifier (no copy; a quantized verifier drafts with its quantized
layers); the drafter has its own, shallower KV cache.
"""

from __future__ import annotations

from quasar.decoding.drafters.base import DrafterOptions
from quasar.decoding.drafters.model_drafter import ModelDrafter
from quasar.model.loading import LoadedModel
from quasar.verifiers.pruned import keep_layers


def build(arg: str | None, target: LoadedModel, options: DrafterOptions) -> ModelDrafter:
    n_layers = target.model.config.num_hidden_layers
    if not arg or not arg.isdigit() or not 1 <= int(arg) < n_layers:
        raise ValueError(f"layerskip needs a layer count N with 1 <= N < {n_layers}: 'layerskip:N' (got {arg!r})")
    shallow = keep_layers(target.model, list(range(int(arg))))
    return ModelDrafter(shallow, target.model.config.vocab_size)
