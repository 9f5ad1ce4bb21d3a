"""quantize_(model, config): swap a model's linears for quantized ones, torchao style.

One frozen config dataclass per scheme; a registry maps the config type to the layer that replaces an
nn.Linear. A new scheme is a new config + layer + one `register_scheme` line, not a new branch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from fnmatch import fnmatch
from typing import Any

from torch import nn

from quasar.quant.int8 import Int8Linear, Int8WeightOnlyLinear, check_group_size
from quasar.quant.w4a8 import ACTIVATION_AWARE, GROUP, SUPER_BLOCK, W4A8Linear, block_size, fit_bits


@dataclass(frozen=True)
class W8A8Config:
    """Int8 weights and dynamic int8 activations, int32 accumulation; scales per output channel and token
    (group_size 0) or per group of `group_size` inputs of each."""

    backend: str = "auto"
    lm_head: bool = False
    ignore: tuple[str, ...] = ()  # fnmatch patterns of linears kept in float (mixed precision)
    group_size: int = 0


@dataclass(frozen=True)
class W8A16Config:
    """Int8 weights per output channel; activations stay in the model's float dtype."""

    lm_head: bool = False
    ignore: tuple[str, ...] = ()  # fnmatch patterns of linears kept in float


@dataclass(frozen=True)
class W4A8Config:
    """4-bit weights in blocks (a scale and a min per group of inputs, stored as Q4_K stores them) and dynamic int8
    activations per 32 inputs; fitted to the inputs' mean squares ('awq'), by min-max rounding ('rtn'), or with awq's
    scales and error-compensating rounding of the quants ('gptq'). llama_cpp_fallbacks: where 256 (a K-quant
    super-block) does not divide a linear's inputs, the bits llama.cpp's Q4_K_M falls back to there (5-bit blocks for
    its Q5_0), and int8 per 32 inputs where it gives 6 bits or more (int8_in_w4a8)."""

    group_size: int = 32
    method: str = "awq"
    llama_cpp_fallbacks: bool = False  # what a checkpoint that records none holds; quant.recipe fits with them
    lm_head: bool = True
    ignore: tuple[str, ...] = ()
    backend: str = "auto"


@dataclass(frozen=True)
class Scheme:
    name: str
    # (linear, config, its inputs' mean square [K] or None, their summed x^T x [K, K] or None, its Place) -> layer
    from_float: Callable[[nn.Linear, Any, Any, Any, Any], nn.Module]
    empty: Callable[[int, int, bool, Any, Any], nn.Module]  # (in, out, bias, config, Place) -> layer to load into


SCHEMES: dict[type, Scheme] = {}
SCHEME_CONFIGS: dict[str, type] = {}


def register_scheme(config_type: type, scheme: Scheme) -> None:
    SCHEMES[config_type] = scheme
    SCHEME_CONFIGS[scheme.name] = config_type


register_scheme(W8A8Config, Scheme(
    "w8a8",
    lambda linear, cfg, *_: Int8Linear.from_float(linear, cfg.backend, cfg.group_size),
    lambda k, n, bias, cfg, _: Int8Linear(k, n, bias, cfg.backend, cfg.group_size),
))
register_scheme(W8A16Config, Scheme(
    "w8a16",
    lambda linear, cfg, *_: Int8WeightOnlyLinear.from_float(linear),
    lambda k, n, bias, cfg, _: Int8WeightOnlyLinear(k, n, bias),
))


@dataclass(frozen=True)
class Place:
    """Where a target linear sits: its name, its decoder layer (None for the lm_head) and the model's layer count."""

    name: str
    layer: int | None
    layers: int


def place_of(model: nn.Module, name: str) -> Place:
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
    return Place(name, layer, len(model.model.layers) if hasattr(model, "model") else 0)


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers and every third between, where its Q4_K_M
    gives attn_v and ffn_down Q6_K (Q8_0 where 256 does not divide their inputs)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def int8_in_w4a8(cfg: W4A8Config, place: Place, in_features: int) -> bool:
    """Whether a w4a8 scheme with llama.cpp's fallbacks keeps this linear in int8 per 32 inputs, where llama.cpp's
    Q4_K_M gives it 6 bits or more: the lm_head where 256 does not divide its inputs (its Q8_0; the other lm_heads stay
    in 4-bit blocks), and v_proj and down_proj in llama.cpp's more-bits layers (its Q6_K or Q8_0: 6.56 or 8.5 bits)."""
    if not cfg.llama_cpp_fallbacks:
        return False
    if place.layer is None:
        return in_features % SUPER_BLOCK != 0
    return place.name.rsplit(".", 1)[-1] in ("v_proj", "down_proj") and more_bits(place.layer, place.layers)


def fit_w4a8(linear: nn.Linear, cfg: W4A8Config, importance: Any, hessian: Any, place: Place) -> nn.Module:
    """The activation-aware fit where the calibration saw the linear's inputs (the lm_head's too); min-max without."""
    if int8_in_w4a8(cfg, place, linear.in_features):
        return Int8Linear.from_float(linear, cfg.backend, GROUP)
    search = cfg.method in ACTIVATION_AWARE and importance is not None
    return W4A8Linear.from_float(linear, cfg.group_size, importance, search, hessian if cfg.method == "gptq" else None,
                                 fit_bits(linear.in_features, cfg.llama_cpp_fallbacks))


def empty_w4a8(k: int, n: int, bias: bool, cfg: W4A8Config, place: Place) -> nn.Module:
    if int8_in_w4a8(cfg, place, k):
        return Int8Linear(k, n, bias, cfg.backend, GROUP)
    return W4A8Linear(k, n, bias, block_size(k), fit_bits(k, cfg.llama_cpp_fallbacks))


register_scheme(W4A8Config, Scheme("w4a8", fit_w4a8, empty_w4a8))


def scheme_config(name: str, **options: Any) -> Any:
    """'w8a8' + options -> W8A8Config(...)."""
    if name not in SCHEME_CONFIGS:
        raise ValueError(f"unknown quantization scheme {name!r}; choose from {', '.join(SCHEME_CONFIGS)}")
    fields = SCHEME_CONFIGS[name].__dataclass_fields__
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if k in fields}
    return SCHEME_CONFIGS[name](**options)


def scheme_name(config: Any) -> str:
    return SCHEMES[type(config)].name


def config_dict(config: Any) -> dict[str, Any]:
    return {"scheme": scheme_name(config), **asdict(config)}


def target_linears(model: nn.Module, config: Any) -> list[str]:
    """Names of the linears a scheme quantizes: every decoder-layer linear not ignored, lm_head only when asked."""
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("model.layers.")]
    names += ["lm_head"] if getattr(config, "lm_head", False) else []
    return [n for n in names if not any(fnmatch(n, pattern) for pattern in getattr(config, "ignore", ()))]


def swap_module_(model: nn.Module, name: str, layer: nn.Module) -> None:
    """Replace the submodule `name` of `model` by `layer`."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def check_targets(model: nn.Module, config: Any, names: list[str]) -> None:
    """Refuse a scheme that cannot quantize every target (a group size that does not divide a layer's K)
    before anything is swapped."""
    for name in names:
        check_group_size(getattr(config, "group_size", 0), model.get_submodule(name).in_features, name)


def quantize_(model: nn.Module, config: Any, mean_squares: dict[str, Any] | None = None,
              hessians: dict[str, Any] | None = None) -> list[str]:
    """Replace the target linears of `model` in place by quantized layers; returns their names. mean_squares: each
    linear's inputs' mean square per channel, hessians their summed x^T x (calibration), for schemes that fit to them."""
    from quasar.progress import progress

    scheme = SCHEMES[type(config)]
    names = target_linears(model, config)
    check_targets(model, config, names)
    for name in progress(names, f"quantizing to {scheme.name}"):
        linear = model.get_submodule(name)
        swap_module_(model, name, scheme.from_float(linear, config, (mean_squares or {}).get(name),
                                                    (hessians or {}).get(name), place_of(model, name)))
    return names


def prepare_empty_(model: nn.Module, config: Any) -> list[str]:
    """Replace the target linears by empty quantized layers of the same shapes (to load a checkpoint into)."""
    scheme = SCHEMES[type(config)]
    names = target_linears(model, config)
    check_targets(model, config, names)
    for name in names:
        linear = model.get_submodule(name)
        swap_module_(model, name, scheme.empty(linear.in_features, linear.out_features, linear.bias is not None, config,
                                               place_of(model, name)))
    return names
