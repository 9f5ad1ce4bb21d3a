"""A quantization recipe end to end: calibrate the float model, smooth it, swap its linears for int8 ones."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from quasar import __version__
from quasar.loading import LoadedModel
from quasar.quant.calibration import Calibration, CalibrationSpec, calibrate, calibration_texts, token_windows
from quasar.quant.schemes import config_dict, quantize_, scheme_config
from quasar.quant.smoothquant import SmoothConfig, row_sites, smooth_

log = logging.getLogger("quasar")


@dataclass(frozen=True)
class QuantRecipe:
    """Everything that decides the quantized weights (and so keys the on-disk cache)."""

    scheme: str = "w8a8"
    alpha: float | str | None = "auto"  # smoothing strength; ignored (no smoothing) for weight-only schemes
    calib: CalibrationSpec = field(default_factory=CalibrationSpec)
    lm_head: bool = False
    output_groups: bool = True  # smooth v -> o and up -> down too
    backend: str = "auto"
    ignore: tuple[str, ...] = ()  # fnmatch patterns of linears kept in float, e.g. "model.layers.29.*"

    @property
    def smoothing(self) -> SmoothConfig | None:
        if self.scheme != "w8a8" or self.alpha is None:
            return None
        return SmoothConfig(alpha=self.alpha, output_groups=self.output_groups)

    def scheme_config(self) -> Any:
        return scheme_config(self.scheme, lm_head=self.lm_head, backend=self.backend, ignore=self.ignore)

    def settings(self) -> dict[str, Any]:
        smoothing = self.smoothing
        return {
            "scheme": self.scheme,
            "alpha": self.alpha if smoothing else None,
            "calibration": asdict(self.calib) if smoothing else None,
            "lm_head": self.lm_head,
            "output_groups": self.output_groups if smoothing else None,
            **({"ignore": list(self.ignore)} if self.ignore else {}),
        }


def calibrate_model(loaded: LoadedModel, spec: CalibrationSpec, smoothing: SmoothConfig) -> Calibration:
    windows = token_windows(loaded.tokenizer, calibration_texts(spec), spec.samples, spec.seq_len)
    return calibrate(loaded.model, windows, row_sites(loaded.model, smoothing))


def quantize_model(loaded: LoadedModel, recipe: QuantRecipe, calib: Calibration | None = None) -> dict[str, Any]:
    """Quantize loaded.model (float32) in place; returns the `quantization` block for config.json.

    `calib` may be passed to reuse one calibration run for several recipes (on copies of the model).
    """
    model: nn.Module = loaded.model
    alphas: dict[str, float | None] = {}
    smoothing = recipe.smoothing
    if smoothing is not None:
        calib = calib or calibrate_model(loaded, recipe.calib, smoothing)
        alphas = smooth_(model, calib, smoothing)
    quantize_(model, recipe.scheme_config())
    return {
        **config_dict(recipe.scheme_config()),
        "alpha": recipe.alpha if smoothing else None,
        "alphas": alphas,
        "output_groups": recipe.output_groups if smoothing else None,
        "calibration": recipe.calib.describe() if smoothing else None,
        "source": str(loaded.source),
        "source_sha256": loaded.source_sha256,
        "quasar_version": __version__,
    }
