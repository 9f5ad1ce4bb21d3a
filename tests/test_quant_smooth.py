"""SmoothQuant: the formula, function preservation (float logits unchanged), and the alpha search."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_hf_model, write_hf_dir

from quasar.model.loading import load
from quasar.quant.calibration import calibrate
from quasar.quant.smoothquant import SmoothConfig, group_error, parse_alpha, row_sites, smooth_, smooth_scales


def test_smooth_scales_formula():
    act, weight = torch.tensor([4.0, 1.0, 0.0]), torch.tensor([1.0, 4.0, 2.0])
    s = smooth_scales(act, weight, 0.5)
    assert torch.allclose(s[:2], torch.tensor([2.0, 0.5]))
    assert s[2] > 0  # a dead channel does not divide by zero
    assert torch.allclose(smooth_scales(act, weight, 1.0)[:2], act[:2])


def test_parse_alpha():
    assert parse_alpha("auto") == "auto" and parse_alpha("none") is None and parse_alpha("0.3") == 0.3
    for bad in ("1.5", "x"):
        with pytest.raises(ValueError):
            parse_alpha(bad)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request, tmp_path_factory, tokenizer_dir):
    """A tiny model per family (qwen2: biases; qwen3: q/k norms; all with grouped-query attention)."""
    hf = tiny_hf_model(request.param, seed=3)
    return load(write_hf_dir(hf, tmp_path_factory.mktemp(request.param), tokenizer_dir))


def _windows(n: int = 3, T: int = 48) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 49152, (1, T), generator=g) for _ in range(n)]


def _logits(model, ids):
    return model(ids, model.new_cache(ids.shape[1]))


@pytest.mark.parametrize("alpha", [0.5, 0.85, "auto"])
def test_smoothing_leaves_float_logits_unchanged(tiny, alpha):
    config = SmoothConfig(alpha=alpha)
    model = copy.deepcopy(tiny.model)
    calib = calibrate(model, _windows(), row_sites(model, config))
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(1))
    before = _logits(model, ids)
    chosen = smooth_(model, calib, config)
    assert len(chosen) == 4 * len(model.model.layers)
    norm = model.model.layers[0].input_layernorm.weight
    assert alpha == "auto" or not torch.equal(norm, tiny.model.model.layers[0].input_layernorm.weight)
    torch.testing.assert_close(_logits(model, ids), before, atol=1e-4, rtol=0)


def test_auto_alpha_never_worse_than_no_smoothing_on_calibration_rows(tiny):
    config = SmoothConfig(alpha="auto")
    model = copy.deepcopy(tiny.model)
    calib = calibrate(model, _windows(), row_sites(model, config))
    name = "model.layers.0.mlp.gate_proj"
    rows = calib.rows[name]
    mlp = model.model.layers[0].mlp
    weight = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float()
    errors = {a: group_error(rows, weight, smooth_scales(calib.absmax[name], weight.abs().amax(0), a)) for a in config.grid}
    chosen = smooth_(model, calib, config)["model.layers.0.post_attention_layernorm"]
    best = min(min(errors.values()), group_error(rows, weight, None))
    picked = group_error(rows, weight, None) if chosen is None else errors[chosen]
    assert picked == pytest.approx(best)
