"""The 'pruned:N' verifier: the float model with N layers dropped (the paper's structural-pruning baseline).

Which layers: the N layers just before the last one, i.e. layers L-1-N .. L-2 of L. Deep layers except
the final one change the residual stream least (Gromov et al. 2024, "The Unreasonable Ineffectiveness of
the Deeper Layers"; Men et al. 2024, ShortGPT), so this is the usual training-free choice. The first
and last layers are always kept. The float dtype is bf16, the paper's baseline precision.
"""

from __future__ import annotations

import dataclasses

import torch

from quasar.kernels.plan import prepare_
from quasar.spec import VerifierSpec
from quasar.model.loading import LoadedModel, load
from quasar.model.source import ModelSource
from quasar.model.llama import Layers, Transformer


def keep_layers(model: Transformer, keep: list[int]) -> Transformer:
    """A Transformer that runs only model's layers `keep` (in order), sharing every weight with model.

    The kept layers are renumbered 0..len(keep)-1 for the smaller KV cache, so a model whose layers are
    renumbered must not run the original model afterwards: use this on the first layers (renumbering is
    then the identity) or on a model of your own.
    """
    sliding = model.config.sliding_layers  # which layers attend over a window (Gemma 3), by the kept ones' numbers
    config = dataclasses.replace(model.config, num_hidden_layers=len(keep),
                                 sliding_layers=tuple(sliding[i] for i in keep) if sliding else ())
    with torch.device("meta"):
        small = type(model)(config)
    small.model.embed_tokens = model.model.embed_tokens
    small.model.layers = Layers(model.model.layers[i] for i in keep)
    small.model.norm = model.model.norm
    small.lm_head = model.lm_head
    small.reset_rope()
    for new_index, layer in enumerate(small.model.layers):
        layer.self_attn.layer = new_index
    prepare_(small)  # on the kernels when model is: its own fused stack over the shared layers
    return small


def dropped_layers(n_layers: int, n_drop: int) -> list[int]:
    """The layers 'pruned:N' drops: the N just before the last one."""
    if not 0 <= n_drop <= n_layers - 2:
        raise ValueError(f"pruned:N needs 0 <= N <= {n_layers - 2} for a {n_layers}-layer model, got {n_drop}")
    return list(range(n_layers - 1 - n_drop, n_layers - 1))


def load_pruned(model: ModelSource, spec: VerifierSpec, owned: bool = True) -> LoadedModel:
    loaded = load(model, "bf16")
    n_layers = loaded.model.config.num_hidden_layers
    drop = set(dropped_layers(n_layers, spec.layers))
    loaded.model = keep_layers(loaded.model, [i for i in range(n_layers) if i not in drop])
    return loaded
