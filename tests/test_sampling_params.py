"""SamplingParams refuses, with a ValueError naming the field, what generation would fail on later: the CLI and
the server share this rule."""

from __future__ import annotations

import math

import pytest
import torch

from quasar.decoding.sampling import SamplingParams


def torch_takes(seed: object) -> bool:
    try:
        torch.Generator().manual_seed(seed)  # type: ignore[arg-type]
    except (ValueError, RuntimeError, TypeError):
        return False
    return True


@pytest.mark.parametrize("seed", [0, 7, -1, -(2**63), -(2**63) - 1, 2**63, 2**64 - 1, 2**64, 10**30, True, 1.5, "7"])
def test_a_seed_is_accepted_exactly_when_torch_can_use_it(seed):
    if torch_takes(seed):
        params = SamplingParams(temperature=1.0, seed=seed)
        assert torch.multinomial(torch.ones(4), 1, generator=params.generator()).item() in range(4)
    else:
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(temperature=1.0, seed=seed)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", math.nan), ("temperature", math.inf), ("top_p", 0.0), ("top_p", math.nan),
    ("top_k", -1), ("min_p", -0.1), ("min_p", 1.5), ("min_p", math.nan), ("max_new_tokens", 0),
])
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
