"""Shared fixtures: tiny random Llama-family models (written as HF directories) and the real default model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import default_source

from quasar.model.loading import LoadedModel, load

TINY = {
    "vocab_size": 49152,  # the default model's tokenizer, so tiny models can run the whole engine
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
              "gemma3_text": "Gemma3ForCausalLM"}
TINY_GEMMA3 = {  # three layers: sliding, global, sliding; a window of 8 so that short prompts outgrow it
    "num_hidden_layers": 3, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "tie_word_embeddings": True,
}


def tiny_hf_model(model_type: str, seed: int = 0, **overrides):
    """A transformers model with random weights (the reference implementation)."""
    import transformers

    cfg = dict(TINY, model_type=model_type) | (TINY_GEMMA3 if model_type == "gemma3_text" else {}) | overrides
    if model_type == "qwen3":
        cfg.setdefault("head_dim", 32)
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, HF_CLASSES[model_type])(config).eval()
    with torch.no_grad():  # make norms non-trivial so their weights matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The real embedded default model, fp32 (converted and cached on first use)."""
    return load(default_source(), "fp32")


@pytest.fixture(scope="session")
def tokenizer_dir(default_model: LoadedModel, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    for f in default_model.directory.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    return out


def write_hf_dir(hf_model, out: Path, tokenizer_dir: Path) -> Path:
    """Save a transformers model as config.json + model.safetensors (+ tokenizer files)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A tiny random llama as a Hugging Face directory (uses the default model's tokenizer)."""
    return write_hf_dir(tiny_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir) -> LoadedModel:
    return load(tiny_model_dir, "fp32")


# ---- quasar's CPU kernels: skip where this machine cannot build them, fail where the build broke ---------

from quasar.kernels import native  # noqa: E402

needs_kernels = pytest.mark.skipif(native.kernel() is None, reason=f"quasar's CPU kernels: {native.status()}")


def pytest_report_header(config) -> str:
    return f"quasar's CPU kernels: {native.status()}"


def pytest_sessionstart(session) -> None:
    """A machine that can build the kernels (AVX2 and a C++ compiler) but failed to must not pass the suite
    by skipping every kernel test."""
    status = native.status()
    if status.state == "failed":
        pytest.exit(f"quasar's CPU kernels failed to build on a machine that can build them: {status.reason}", returncode=1)




@pytest.fixture(params=["torch", "kernel"])
def sampling_path(request, monkeypatch):
    """Run a sampling test on torch and on quasar's sampling kernel (sampling.on_cpu decides which runs)."""
    from quasar.decoding import sampling

    if request.param == "kernel":
        if native.kernel() is None:
            pytest.skip(f"quasar's CPU kernels: {native.status()}")
        monkeypatch.setattr(sampling, "on_cpu", lambda kernel, t: native.kernel() if t.device.type == "cpu" and t.dtype == torch.float32 else None)
    else:
        monkeypatch.setattr(sampling, "on_cpu", lambda kernel, t: None)
    return request.param
