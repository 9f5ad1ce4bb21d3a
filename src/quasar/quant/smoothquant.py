"""SmoothQuant (Xiao et al., 2023, arXiv 2211.10438): move activation outliers into the weights.

s_j = max|X_j|^alpha / max|W_j|^(1-alpha); X' = X / s (folded into whatever produces X), W' = W * s
(columns), so X' W'^T = X W^T: the float function is unchanged, but X' is easier to quantize per token.

Which module produces which linears' input is a data table (llm-compressor style). A norm folds 1/s into
its weight; a linear folds 1/s into its output rows (v -> o through attention, up -> down through the
SwiGLU product, both linear in that factor). With grouped-query attention one kv head feeds several query
heads, so the o_proj scale is tied across the heads of a group.

alpha is global (a float), `None` (no smoothing) or searched per group ("auto", the "enhanced" SmoothQuant
of Quasar): the candidate — any grid alpha or no smoothing — that minimises the relative output error of
the group's fake-quantized (W8A8) linears on sampled calibration rows. The chosen alpha is recorded.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from quasar.model.config import ModelConfig
from quasar.quant.calibration import Calibration
from quasar.quant.int8 import dequantize, quantize_groups

log = logging.getLogger("quasar")


@dataclass(frozen=True)
class SmoothGroup:
    source: str  # module (relative to a decoder layer) whose output is the linears' input
    linears: tuple[str, ...]  # linears that read it
    folds_into: str  # "norm": scale the norm weight; "rows": scale the source linear's output rows


SMOOTH_GROUPS = (
    SmoothGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "norm"),
    SmoothGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "norm"),
    SmoothGroup("self_attn.v_proj", ("self_attn.o_proj",), "rows"),
    SmoothGroup("mlp.up_proj", ("mlp.down_proj",), "rows"),
)
GEMMA_SMOOTH_GROUPS = (  # the post-norms (post_attention_layernorm, post_feedforward_layernorm) feed the residual
    SMOOTH_GROUPS[0], SmoothGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "norm"), *SMOOTH_GROUPS[2:],
)
ALPHA_GRID = tuple(round(0.05 * i, 2) for i in range(21))


@dataclass(frozen=True)
class SmoothConfig:
    alpha: float | str | None = "auto"  # a float, "auto" (search per group) or None (no smoothing)
    grid: tuple[float, ...] = ALPHA_GRID
    output_groups: bool = True  # also smooth v -> o and up -> down
    group_size: int = 0  # the W8A8 scales the alpha search simulates: 0 per channel/token, else per G inputs

    def groups(self, model: ModelConfig) -> tuple[SmoothGroup, ...]:
        """The groups smoothed in each layer of `model` (Gemma's MLP reads its pre-feedforward norm)."""
        groups = GEMMA_SMOOTH_GROUPS if model.gemma else SMOOTH_GROUPS
        return groups if self.output_groups else tuple(g for g in groups if g.folds_into == "norm")


def parse_alpha(text: str) -> float | str | None:
    """'auto' | 'none' | a float in [0, 1]."""
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    try:
        alpha = float(text)
    except ValueError as e:
        raise ValueError(f"--alpha must be auto, none or a number in [0, 1], not {text!r}") from e
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"--alpha must lie in [0, 1], not {alpha}")
    return alpha


def smooth_scales(act_absmax: torch.Tensor, weight_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = max|X|^alpha / max|W|^(1-alpha), both clamped away from zero (SmoothQuant eq. 4)."""
    act, weight = act_absmax.float().clamp(min=1e-5), weight_absmax.float().clamp(min=1e-5)
    return (act.pow(alpha) / weight.pow(1 - alpha)).clamp(min=1e-5)


def tie_heads(x: torch.Tensor, n_kv: int, group: int) -> torch.Tensor:
    """[H*D] -> [H_kv*D]: max over the query heads that share a kv head."""
    return x.view(n_kv, group, -1).amax(dim=1).reshape(-1)


def dequantized(t: torch.Tensor, group_size: int) -> torch.Tensor:
    """t [R, K] rounded to int8 with its scales and back (fake quantization)."""
    return dequantize(*quantize_groups(t, group_size))


def group_error(rows: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, group_size: int = 0) -> float:
    """Relative error of W8A8 (x / s) (W * s)^T against x W^T; rows [R, K], weight [N, K], scales [K]."""
    reference = rows @ weight.t()  # [R, N]
    s = torch.ones(rows.shape[1]) if scales is None else scales
    approx = dequantized(rows / s, group_size) @ dequantized(weight * s, group_size).t()
    return ((approx - reference).pow(2).sum() / reference.pow(2).sum().clamp(min=1e-12)).item()


class _Site:
    """One group in one decoder layer: the modules, and the statistics seen by its linears."""

    def __init__(self, layer: nn.Module, prefix: str, group: SmoothGroup, calib: Calibration, config: Any) -> None:
        self.source = layer.get_submodule(group.source)
        self.linears = [layer.get_submodule(n) for n in group.linears]
        self.names = [f"{prefix}.{n}" for n in group.linears]
        self.group = group
        self.act_absmax = calib.absmax[self.names[0]]  # [K]
        self.rows = calib.rows.get(self.names[0])  # [R, K] or None
        self.n_kv, self.heads = config.num_key_value_heads, config.num_attention_heads
        self.tied = group.folds_into == "rows" and self.source.out_features != self.linears[0].in_features

    def weight(self) -> torch.Tensor:
        return torch.cat([m.weight.detach().float() for m in self.linears])  # [N_total, K]

    def scales(self, alpha: float, wmax: torch.Tensor | None = None) -> torch.Tensor:
        """s [K] for `alpha`; wmax [K] (the weight's column absmax) may be passed when already known."""
        act, wmax = self.act_absmax, self.weight().abs().amax(dim=0) if wmax is None else wmax
        if not self.tied:
            return smooth_scales(act, wmax, alpha)
        g = self.heads // self.n_kv
        s = smooth_scales(tie_heads(act, self.n_kv, g), tie_heads(wmax, self.n_kv, g), alpha)  # [H_kv*D]
        return s.view(self.n_kv, 1, -1).expand(self.n_kv, g, s.numel() // self.n_kv).reshape(-1)  # [H*D]

    def source_scales(self, s: torch.Tensor) -> torch.Tensor:
        """The factor for the source's outputs: [H_kv*D] when heads are tied, else s itself."""
        return s.view(self.n_kv, self.heads // self.n_kv, -1)[:, 0].reshape(-1) if self.tied else s

    @torch.no_grad()
    def apply(self, s: torch.Tensor) -> None:
        for m in self.linears:
            m.weight.mul_(s.to(m.weight.dtype))
        src = self.source_scales(s).to(self.source.weight.dtype)
        if self.group.folds_into == "norm":
            self.source.divide_(src)
            return
        self.source.weight.div_(src[:, None])
        if self.source.bias is not None:
            self.source.bias.div_(src)


SEARCH_CHANNELS = 1024  # output channels the alpha search scores (evenly spaced): the error estimate, 20x cheaper on a 1.5B MLP


def choose_alpha(site: _Site, config: SmoothConfig) -> float | None:
    """The candidate with the least output error on the sampled rows. Each output channel is quantized on its
    own, so scoring an evenly spaced subset of channels measures the same error at a fraction of the cost."""
    if config.alpha != "auto":
        return config.alpha
    if site.rows is None:
        raise ValueError(f"alpha search needs sampled calibration rows for {site.names[0]}")
    weight, G = site.weight(), config.group_size
    wmax = weight.abs().amax(dim=0)  # [K], over every channel: the scales the group will really get
    if weight.shape[0] > SEARCH_CHANNELS:
        weight = weight[torch.linspace(0, weight.shape[0] - 1, SEARCH_CHANNELS).long()]  # [SEARCH_CHANNELS, K]
    errors = {None: group_error(site.rows, weight, None, G)}
    errors.update({a: group_error(site.rows, weight, site.scales(a, wmax), G) for a in config.grid})
    return min(errors, key=errors.get)


def row_sites(model: nn.Module, config: SmoothConfig) -> set[str]:
    """The linears whose input rows the alpha search needs (the first linear of every group)."""
    n = len(model.model.layers)
    return {f"model.layers.{i}.{g.linears[0]}" for i in range(n) for g in config.groups(model.config)}


def smooth_(model: nn.Module, calib: Calibration, config: SmoothConfig) -> dict[str, float | None]:
    """Smooth every group of every decoder layer in place; returns {'model.layers.i.source': alpha}."""
    from quasar.progress import progress

    chosen: dict[str, float | None] = {}
    what = "searching alpha per smoothing group" if config.alpha == "auto" else "smoothing"
    for i, layer in enumerate(progress(model.model.layers, what)):
        for group in config.groups(model.config):
            site = _Site(layer, f"model.layers.{i}", group, calib, model.config)
            alpha = choose_alpha(site, config)
            if alpha is not None:
                site.apply(site.scales(alpha))
            chosen[f"model.layers.{i}.{group.source}"] = alpha
    log.info("smoothing: %s", _summary(chosen))
    return chosen


def _summary(chosen: dict[str, float | None]) -> str:
    counts: dict[str, int] = {}
    for a in chosen.values():
        counts[str(a)] = counts.get(str(a), 0) + 1
    return ", ".join(f"alpha={k}: {v}" for k, v in sorted(counts.items()))
