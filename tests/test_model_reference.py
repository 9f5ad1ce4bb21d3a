"""Our model's logits equal Hugging Face transformers' implementation of the same weights."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_hf_model, write_hf_dir

from quasar.model.loading import load
from quasar.model.config import ModelConfig, UnsupportedModelError
from quasar.model.llama import Transformer

REAL_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden screw press into a system that could produce books "
    "quickly and cheaply. Before this, books were copied by hand, usually by monks in monasteries, and a "
    "single volume could take months to finish. The new technology spread rapidly across Europe: by 1500, "
    "printing presses in more than two hundred cities had produced millions of copies. Literacy rose, "
    "scientific ideas travelled faster, and the Reformation was carried by pamphlets. Historians still argue "
    "about how much of the modern world follows from that one invention, but few doubt that it changed how "
    "knowledge was stored and shared. In the centuries that followed, presses became faster: steam power, "
    "rotary cylinders and eventually offset lithography multiplied output again, and newspapers became daily "
    "reading for ordinary people. Today, digital text has taken over many of the press's roles, yet the basic "
    "idea remains the same: make copies cheap, and ideas will travel further than their authors ever could."
)


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
        ("mistral", {}),
        ("qwen2", {}),
        ("qwen3", {}),
        ("gemma3_text", {}),
    ],
)
def test_tiny_logits_match_transformers(model_type, overrides, tmp_path, tokenizer_dir):
    hf = tiny_hf_model(model_type, **overrides)
    ours = load(write_hf_dir(hf, tmp_path / model_type, tokenizer_dir), "fp32").model
    ids = torch.randint(0, 49152, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids, ours.new_cache(64, batch=2))
    assert (got - expected).abs().max().item() <= 1e-4


def test_gemma3_step_by_step_past_the_sliding_window_matches_transformers(tmp_path, tokenizer_dir):
    """A prompt of 20 tokens, then 12 single-token steps and one 5-token step, on a model whose sliding window is 8:
    every step's logits equal transformers' on the whole sequence."""
    hf = tiny_hf_model("gemma3_text")
    ours = load(write_hf_dir(hf, tmp_path / "gemma3", tokenizer_dir), "fp32").model
    ids = torch.randint(0, 49152, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits[0]
        cache = ours.new_cache(64)
        got = [ours(ids[:, :20], cache)[0]]
        got += [ours(ids[:, i : i + 1], cache)[0] for i in range(20, 32)]
        got += [ours(ids[:, 32:], cache)[0]]
    assert (torch.cat(got) - expected).abs().max().item() <= 1e-4


def test_unsupported_model_type_names_the_supported_ones():
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf({"model_type": "gpt2"})


@pytest.fixture(scope="module")
def hf_default():
    from transformers import AutoModelForCausalLM

    from quasar.model.loading import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_default_model_logits_match_transformers(default_model, hf_default):
    ids = default_model.tokenizer(REAL_TEXT, return_tensors="pt").input_ids
    assert ids.shape[1] >= 200
    with torch.no_grad():
        expected = hf_default(ids).logits
        got = default_model.model(ids, default_model.model.new_cache(ids.shape[1]))
    max_diff = (got - expected).abs().max().item()
    print(f"default model, {ids.shape[1]} tokens: max |logit diff| vs transformers = {max_diff:.3g}")
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert max_diff <= 1e-3


@pytest.mark.parametrize(
    "prompt",
    [
        "Explain in detail how a bicycle works.",
        "Write a Python function that reverses a string, and explain it.",
        "Tell me a long story about a cat who learns to fly.",
    ],
)
def test_default_model_greedy_matches_transformers_generate(default_model, hf_default, prompt):
    from quasar.decoding.engine import Engine
    from quasar.decoding.sampling import SamplingParams

    engine = Engine(default_model)
    ids = engine.encode(prompt)
    ours = engine.generate(ids, SamplingParams(max_new_tokens=64)).token_ids
    with torch.no_grad():
        out = hf_default.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
    assert len(ours) == 64
    assert ours == out[0, len(ids) :].tolist()


@pytest.mark.parametrize("head_dim", [64, 48])
def test_rope_rows_from_the_table_are_the_floats_computed_per_step(head_dim):
    """A step reads its cos and sin from a table of every position (grown in powers of two); a row must be the
    same floats that computing it for the step alone gives, or the kernels' and the torch path's logits drift."""
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=4 * head_dim, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rope_theta=10000.0)
    model = Transformer(config)
    for start, n in [(0, 1), (5, 6), (255, 2), (700, 1), (3, 8), (1023, 1)]:  # 255 + 2 and 700 grow the table
        positions = torch.arange(start, start + n)
        direct = model.rope_values(positions)
        for got in (model.rope_span(start, n), model.rope(positions)):
            assert all(torch.equal(a, b) for a, b in zip(got, direct))
    scattered = torch.tensor([9, 2, 600, 600, 41])
    assert all(torch.equal(a, b) for a, b in zip(model.rope(scattered), model.rope_values(scattered)))
    assert model.rope_span(10, 2)[0].is_contiguous()
    model.inv_freq = model.inv_freq * 2  # a new inv_freq (as loading sets one) rebuilds the table
    assert torch.equal(model.rope_span(3, 1)[0], model.rope_values(torch.tensor([3]))[0])
