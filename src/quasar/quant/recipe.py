"""A quantization recipe end to end: calibrate the float model, smooth it, swap its linears for int8 ones."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from quasar.model.loading import LoadedModel
from quasar.quant.bf16 import use_bf16_linears_
from quasar.quant.calibration import Calibration, CalibrationSpec, calibrate, calibration_texts, token_windows
from quasar.quant.schemes import check_targets, config_dict, quantize_, scheme_config, target_linears
from quasar.quant.smoothquant import SmoothConfig, parse_alpha, row_sites, smooth_
from quasar.quant.w4a8 import ACTIVATION_AWARE
from quasar.spec import VerifierSpec
from quasar.version import __version__

log = logging.getLogger("quasar")


# The group size of plain `w8a8`: the finest scales that keep the speed (the table in docs/quantization.md).
DEFAULT_W8A8_GROUP = 32
# A w8a8 verifier's lm_head is W8A8 like the layers by default (llama.cpp's Q8_0 quantizes its output layer too, and
# it stays inside the fidelity bound); ':lmbf16' keeps it in bf16 (the paper's float lm_head).
SCHEME_FORMS = ("w8a8[:pc|:gN][:auto|:none|:ALPHA][:lm8|:lmbf16], w8a16 or w4a8[:gN][:awq|:rtn|:gptq] "
                "(e.g. w8a8, w8a8:g32, w8a8:pc:0.5, w8a8:lmbf16, w4a8:g32)")
DEFAULT_W4A8_GROUP = 32


@dataclass(frozen=True)
class QuantRecipe:
    """Everything that decides the quantized weights (and so keys the on-disk cache)."""

    scheme: str = "w8a8"
    alpha: float | str | None = "auto"  # smoothing strength; ignored (no smoothing) for weight-only schemes
    calib: CalibrationSpec = field(default_factory=CalibrationSpec)
    lm_head: bool | None = None  # quantize the lm_head too; None: yes for w8a8 and w4a8, no (bf16 weights) for w8a16
    output_groups: bool = True  # smooth v -> o and up -> down too
    backend: str = "auto"
    ignore: tuple[str, ...] = ()  # fnmatch patterns of linears kept in float, e.g. "model.layers.29.*"
    group_size: int = DEFAULT_W8A8_GROUP  # w8a8 / w4a8 scales per group of G inputs; 0: per channel and token
    method: str = "awq"  # w4a8: fit the blocks to the inputs' mean squares ('awq'), by min-max rounding ('rtn'), or
    # with awq's scales and error-compensating rounding ('gptq')

    def __post_init__(self) -> None:
        if self.lm_head is None:
            object.__setattr__(self, "lm_head", self.scheme in ("w8a8", "w4a8"))

    @property
    def smoothing(self) -> SmoothConfig | None:
        if self.scheme != "w8a8" or self.alpha is None:
            return None
        return SmoothConfig(alpha=self.alpha, output_groups=self.output_groups, group_size=self.group_size)

    @property
    def calibrated(self) -> bool:
        """Whether the float model runs over the calibration set first (smoothing, or w4a8's activation-aware fit)."""
        return self.smoothing is not None or (self.scheme == "w4a8" and self.method in ACTIVATION_AWARE)

    @property
    def input_products(self) -> bool:
        """Whether the calibration sums each linear's x^T x too (w4a8's error-compensating rounding)."""
        return self.scheme == "w4a8" and self.method == "gptq"

    @property
    def spec(self) -> VerifierSpec:
        """The verifier that gives this recipe: w8a8:g64, w8a8:pc:0.5, w8a8:g32:lmbf16, w8a16, w4a8:g32:awq."""
        if self.scheme == "w4a8":
            return VerifierSpec("w4a8", self.group_size, method=self.method)
        if self.scheme != "w8a8":
            return VerifierSpec(self.scheme)
        alpha = None if self.alpha == "auto" else "none" if self.alpha is None else self.alpha
        return VerifierSpec("w8a8", self.group_size, alpha, None if self.lm_head else "lmbf16")

    @property
    def name(self) -> str:
        return str(self.spec)

    def scheme_config(self) -> Any:
        options = {"group_size": self.group_size} if self.scheme in ("w8a8", "w4a8") else {}
        if self.scheme == "w4a8":
            options.update(method=self.method, llama_cpp_fallbacks=True)
        return scheme_config(self.scheme, lm_head=self.lm_head, backend=self.backend, ignore=self.ignore, **options)

    def settings(self) -> dict[str, Any]:
        smoothing = self.smoothing
        return {
            "scheme": self.scheme,
            "group_size": self.group_size if self.scheme in ("w8a8", "w4a8") else None,
            "alpha": self.alpha if smoothing else None,
            "calibration": asdict(self.calib) if self.calibrated else None,
            **({"method": self.method, "llama_cpp_fallbacks": True} if self.scheme == "w4a8" else {}),
            "lm_head": self.lm_head,
            "output_groups": self.output_groups if smoothing else None,
            **({"ignore": list(self.ignore)} if self.ignore else {}),
        }


def recipe_for(spec: VerifierSpec, calib: CalibrationSpec | None = None, **options: Any) -> QuantRecipe:
    """A quantized verifier's recipe: plain 'w8a8' is group size DEFAULT_W8A8_GROUP, alpha auto, the lm_head in W8A8
    with the layers' group size; 'w8a8:pc' per channel and token (the paper's); 'w8a8:none' no smoothing;
    'w8a8:lmbf16' the lm_head in bf16 (as the paper keeps it); 'w8a16' weights only, bf16 lm_head. `options` (the
    `quasar quantize` flags) override what the name leaves unnamed."""
    if spec.kind == "w4a8":
        for name in ("alpha", "output_groups"):
            options.pop(name, None)
        return QuantRecipe("w4a8", None, calib or CalibrationSpec(), group_size=spec.group or DEFAULT_W4A8_GROUP,
                           method=spec.method or "awq", **options)
    if not spec.quantized:
        raise ValueError(f"{spec} is not a quantization scheme; use {SCHEME_FORMS}")
    alpha = options.pop("alpha", None) or spec.alpha or "auto"
    if spec.lm_head is not None:
        options["lm_head"] = spec.int8_lm_head
    if spec.kind == "w8a16":
        return QuantRecipe("w8a16", None, calib or CalibrationSpec(), group_size=0, **options)
    group = DEFAULT_W8A8_GROUP if spec.group is None else spec.group
    return QuantRecipe("w8a8", parse_alpha(str(alpha)), calib or CalibrationSpec(), group_size=group, **options)


def calibrate_model(loaded: LoadedModel, spec: CalibrationSpec, smoothing: SmoothConfig | None,
                    hessians: bool = False) -> Calibration:
    """The float model's statistics over the calibration set (and the input rows smoothing's alpha search needs, and
    with hessians the inputs' summed x^T x)."""
    windows = token_windows(loaded.tokenizer, calibration_texts(spec), spec.samples, spec.seq_len)
    return calibrate(loaded.model, windows, row_sites(loaded.model, smoothing) if smoothing else frozenset(),
                     hessians=hessians)


def quantize_model(loaded: LoadedModel, recipe: QuantRecipe, calib: Calibration | None = None) -> dict[str, Any]:
    """Quantize loaded.model (float32) in place; returns the `quantization` block for config.json.

    `calib` may be passed to reuse one calibration run for several recipes (on copies of the model).
    """
    model: nn.Module = loaded.model
    alphas: dict[str, float | None] = {}
    smoothing = recipe.smoothing
    check_targets(model, recipe.scheme_config(), target_linears(model, recipe.scheme_config()))  # before any work
    if recipe.calibrated:
        calib = calib or calibrate_model(loaded, recipe.calib, smoothing, recipe.input_products)
        if recipe.input_products and not calib.hessians:
            raise ValueError(f"{recipe.name} needs a calibration that summed its inputs' products (hessians=True)")
    if smoothing is not None:
        alphas = smooth_(model, calib, smoothing)
    quantize_(model, recipe.scheme_config(), calib.mean_square() if calib is not None else None,
              calib.hessians if calib is not None else None)  # the scheme takes them where its method rounds by them
    if not recipe.lm_head:  # the float lm_head reads half the bytes as bf16; part of the recipe on every host
        use_bf16_linears_(model, ["lm_head"])
    return {
        **config_dict(recipe.scheme_config()),
        "alpha": recipe.alpha if smoothing else None,
        "alphas": alphas,
        "output_groups": recipe.output_groups if smoothing else None,
        "lm_head_dtype": "int8" if recipe.lm_head else "bf16",
        "calibration": recipe.calib.describe() if recipe.calibrated else None,
        "source": str(loaded.source),
        "source_sha256": loaded.source_sha256,
        "quasar_version": __version__,
    }
