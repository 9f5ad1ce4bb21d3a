"""Confidence-guarded precision ('--guard MARGIN'): the W8A8 verifier decides, except where it is
unsure. A position whose W8A8 top-1 logit leads the runner-up by less than MARGIN is re-scored by the float
model (bf16) before it is accepted: the float model's token is emitted there and the step ends.

The re-score is one float forward over the step's rows up to that position, attending over the request's own
KV cache: the keys and values the W8A8 model wrote for the context before the step. So a re-score costs about
one float decode step, whatever came before it (a float model with its own cache would first have to catch
up on every token emitted since its last run: measured, that catch-up cost more than the re-scores saved).
SmoothQuant divides each value channel by its v -> o smoothing factor (and multiplies o_proj's input by it),
so the float model reads W8A8's values only with the same factors folded into its v_proj and o_proj:
`guard_model` recovers them from the quantized o_proj (read from the verifier's checkpoint) and folds them
(exact in real arithmetic).

Approximate by design, twice: a position where W8A8 is confident but wrong stays wrong, and the float model
sees W8A8's keys and values of the context. With MARGIN = 0 the output is `ngram+w8a8`'s; with an infinite
MARGIN every step's first position is re-scored: the float model decoding over W8A8's prompt cache.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from quasar.model.kv_cache import KVCache
from quasar.model.loading import LoadedModel
from quasar.model.source import ModelSource
from quasar.quant.checkpoint import WEIGHTS
from quasar.model.llama import Transformer
from quasar.quant.int8 import dequantize
from quasar.decoding.sampling import Sampler
from quasar.decoding.stats import GenerationStats
from quasar.decoding.rejection import Verdict


def guard_model(model: ModelSource, verifier: LoadedModel) -> Transformer:
    """The bf16 model of `model` on its plan, with the quantized `verifier`'s v -> o smoothing factors folded in
    (see above); the verifier's o_proj weights are read from its checkpoint, not from the loaded layers (the
    kernels keep those packed)."""
    from quasar.kernels.plan import prepare_
    from quasar.verifiers.float import load_bf16

    float_ = load_bf16(model).model
    config = float_.config
    with torch.no_grad(), safe_open(verifier.directory / WEIGHTS, "pt") as weights:
        for i, f in enumerate(float_.model.layers):
            name = f"model.layers.{i}.self_attn.o_proj"
            w = dequantize(weights.get_tensor(f"{name}.weight"), weights.get_tensor(f"{name}.weight_scale"))
            fold_value_scales_(f.self_attn, value_scales(w, f.self_attn.o_proj.weight, config.num_key_value_heads,
                                                         config.head_dim))
    prepare_(float_)
    return float_


def value_scales(w: torch.Tensor, float_weight: torch.Tensor, n_kv: int, head_dim: int) -> torch.Tensor:
    """s [H_kv * D] with o_proj's dequantized weight w [hidden, H * D] ~ float_weight * s over its input columns, tied across the
    heads that share a kv head: per column, the least-squares ratio over the output channels (their int8 rounding
    averages out: unsmoothed layers come out within 0.2% of 1)."""
    f = float_weight.float()
    s = (w * f).sum(0) / (f * f).sum(0).clamp_min(1e-30)  # [H * D]
    return s.view(n_kv, -1, head_dim).mean(1).reshape(-1)


def fold_value_scales_(attention: torch.nn.Module, s: torch.Tensor) -> None:
    """Values divided by s [H_kv * D] (v_proj's output channels), o_proj's input multiplied by it: the same
    function, with the quantized verifier's values in the cache."""
    v, o = attention.v_proj, attention.o_proj
    v.weight.copy_((v.weight.float() / s[:, None]).to(v.weight.dtype))
    if v.bias is not None:
        v.bias.copy_((v.bias.float() / s).to(v.bias.dtype))
    groups = o.weight.shape[1] // s.numel()  # query heads per kv head
    columns = s.view(attention.n_kv, 1, attention.head_dim).expand(-1, groups, -1).reshape(-1)  # [H * D]
    o.weight.copy_((o.weight.float() * columns[None, :]).to(o.weight.dtype))


class ConfidenceGuard:
    """Re-scores a verify step's unsure positions with the float model (the margin is checked by EngineSpec)."""

    def __init__(self, model: Transformer, margin: float) -> None:
        self.model = model  # the float model: same architecture as the verifier, so it reads the verifier's cache
        self.margin = margin

    @torch.inference_mode()
    def review(self, cache: KVCache, scored: list[int], logits: torch.Tensor, verdict: Verdict, sampler: Sampler,
               stats: GenerationStats) -> Verdict:
        """scored: the step's tokens [last, *draft], whose keys and values end `cache`; logits [k + 1, V] of W8A8's
        verify over them; the verdict W8A8 reached. Returns it, or a shorter one ending in the float model's
        token at the first unsure position among those the verdict emits (then the cache ends at that position,
        its rows written by the float model)."""
        emitted = [*scored[1 : verdict.accepted + 1], verdict.token]
        # the margin of the rows the verdict was reached on: after the request's rules (a banned or masked token
        # neither makes a position unsure nor sure)
        top2 = sampler.picked_from(logits)[: len(emitted)].float().topk(2, dim=-1).values  # [a + 1, 2]
        unsure = ((top2[:, 0] - top2[:, 1]) < self.margin).nonzero()
        if len(unsure) == 0:
            return verdict
        j = int(unsure[0])
        cache.trim(len(scored))  # back to the context before the step
        rows = torch.tensor([scored[: j + 1]], device=self.model.device)
        token = sampler.repick(self.model(rows, cache, last_only=True)[0, -1], scored[1 : j + 1])
        stats.rechecked_tokens += 1
        stats.recheck_changed += token != emitted[j]
        return Verdict(j, token)
