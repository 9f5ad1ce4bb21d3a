"""ModelConfig: the hyper-parameters of a Llama-family or Gemma 3 model, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# config.json "architectures" per model_type: what transformers and vLLM instantiate for generation
CAUSAL_LM_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                     "qwen3": "Qwen3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


class UnsupportedModelError(ValueError):
    """The checkpoint's model_type is not one quasar implements."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Gemma 3 (model/gemma3.py): which layers attend over a sliding window of the last `sliding_window` positions
    # (the others over all), the RoPE base of those layers, and the attention scale's 1 / sqrt(query_pre_attn_scalar)
    sliding_layers: tuple[bool, ...] = ()
    sliding_window: int | None = None
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None

    @property
    def gemma(self) -> bool:
        return self.model_type == "gemma3_text"

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (transformers 4.x and 5.x spellings)."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r}; quasar supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        rope = hf.get("rope_parameters") or {}
        if model_type == "gemma3_text":
            return cls.from_gemma3(hf, rope)
        rope_scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        n_heads = hf["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=dict(rope_scaling) if rope_scaling else None,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids(hf),
        )

    @classmethod
    def from_gemma3(cls, hf: dict[str, Any], rope: dict[str, Any]) -> ModelConfig:
        """A gemma3_text config.json (rope_parameters per layer type in transformers 5, rope_theta and
        rope_local_base_freq in 4.x)."""
        for name in ("final_logit_softcapping", "attn_logit_softcapping"):
            if hf.get(name) is not None:
                raise UnsupportedModelError(f"gemma3_text with {name} is not supported")
        if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"gemma3_text with hidden_activation {hf['hidden_activation']!r} is not supported")
        n_layers = hf["num_hidden_layers"]
        kinds = hf.get("layer_types") or [
            "full_attention" if (i + 1) % hf.get("sliding_window_pattern", 6) == 0 else "sliding_attention"
            for i in range(n_layers)]
        full, local = rope.get("full_attention", {}), rope.get("sliding_attention", {})
        for params in (full, local, hf.get("rope_scaling") or {}):
            if params.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"gemma3_text with rope_type {params['rope_type']!r} is not supported")
        return cls(
            model_type="gemma3_text", vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=n_layers,
            num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
            head_dim=hf["head_dim"], rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=full.get("rope_theta", hf.get("rope_theta", 1_000_000.0)),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=hf.get("tie_word_embeddings", True), attention_bias=hf.get("attention_bias", False),
            qk_norm=True, bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_token_ids(hf),
            sliding_layers=tuple(kind == "sliding_attention" for kind in kinds),
            sliding_window=hf.get("sliding_window"),
            rope_local_theta=local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar", hf["head_dim"]),
        )


def eos_token_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    """config.json's eos_token_id: one id, a list of them, or none."""
    eos = hf.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
