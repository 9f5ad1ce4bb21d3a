import torch


def test_tiny_model_loads_and_runs(tiny_model):
    cache = tiny_model.model.new_cache(32)
    logits = tiny_model.model(torch.tensor([[1, 2, 3]]), cache)
    assert logits.shape == (1, 3, 49152)
    assert cache.length == 3
