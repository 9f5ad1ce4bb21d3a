"""What a model argument names, decided once where a command starts: a `ModelSource`.

    source = ModelSource.at(Path("qwen.Q4_K_M.gguf"))   # format 'gguf', family 'qwen2', quantized_file True
    load(source, "fp32")                               # every loader takes the value, never the text again

The entry (quasar.builder.model_source) maps the names ('default', `quasar models install` names) to a path;
everything below takes the value. Reading a source reads only its metadata: a GGUF's header (its key-value pairs
and tensor table, not its weights) or a directory's config.json; the sha256 of the weights is computed on first
use and remembered (quasar.files.sha256_memo).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quasar.files import ModelLoadError, sha256_memo
from quasar.model.gguf_file import read_gguf_header

FORMATS = {"gguf": "a GGUF file", "hf": "a Hugging Face model directory", "quantized": "a `quasar quantize` directory"}
FLOAT_GGUF_FILE_TYPES = (0, 1, 32)  # general.file_type: all F32, mostly F16, mostly BF16
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}


@dataclass(frozen=True)
class ModelSource:
    """One model as the user named it: where it is, what it is, and what kinds of weights it holds.

    format: 'gguf', 'hf' or 'quantized' (FORMATS); family: the config's model_type ('llama', 'qwen2', ...);
    weights: what its linear weights are, most frequent first (a GGUF's tensor types such as ('Q4_K', 'Q6_K', ...),
    a checkpoint's scheme, or ('float',)); file_type: a GGUF's general.file_type (None for a directory);
    pinned_sha256: the sha256 the weights must have (the embedded default), checked when the sha256 is first read.
    """

    name: str
    path: Path
    format: str
    family: str
    weights: tuple[str, ...]
    file_type: int | None = None
    parameters: int | None = None  # a GGUF's weights, counted from its tensor table
    pinned_sha256: str | None = field(default=None, compare=False)

    @classmethod
    def at(cls, path: Path, name: str | None = None, pinned_sha256: str | None = None) -> ModelSource:
        """The source at path (a .gguf file or a model directory), its metadata read and checked."""
        path = Path(path).expanduser()
        name = name or str(path)
        if not path.exists():
            raise ModelLoadError(f"model path does not exist: {path}")
        if path.is_dir():
            return cls.directory(path, name)
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is neither a model directory nor a .gguf file")
        header = read_gguf_header(path)
        arch = header.fields.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError(f"{path} names no general.architecture: not a model GGUF")
        types = tuple(GGML_TYPES.get(t, f"type {t}") for t, _ in header.tensor_types.most_common())
        return cls(name, path, "gguf", arch, types, header.fields.get("general.file_type"), header.parameters,
                   pinned_sha256)

    @classmethod
    def of(cls, model: ModelSource | str | Path) -> ModelSource:
        """model as it is, or the source at a path (names such as 'default' are the entry's: quasar.builder)."""
        return model if isinstance(model, ModelSource) else cls.at(Path(model))

    @classmethod
    def directory(cls, path: Path, name: str) -> ModelSource:
        try:
            config = json.loads((path / "config.json").read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path} is a directory without config.json (not a Hugging Face model directory)"
                                 ) from None
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read {path / 'config.json'}: {e}") from e
        block = config.get("quantization")
        if block is not None:
            return cls(name, path, "quantized", config.get("model_type", "?"), (str(block.get("scheme", "?")),))
        return cls(name, path, "hf", config.get("model_type", "?"), ("float",))

    @property
    def quantized_file(self) -> bool:
        """A GGUF whose weights are quantized blocks (Q4_K_M, Q8_0, ...), not a float one."""
        return self.format == "gguf" and self.file_type not in FLOAT_GGUF_FILE_TYPES

    @property
    def quantization(self) -> dict[str, Any] | None:
        """The `quantization` block of a `quasar quantize` checkpoint; None for anything else."""
        if self.format != "quantized":
            return None
        return json.loads((self.path / "config.json").read_text())["quantization"]

    @functools.cached_property
    def sha256(self) -> str:
        """The identity of the source weights: a GGUF file's sha256, or one over a directory's safetensors files
        (memoised by path, size and mtime, so a warm start does not re-read gigabytes)."""
        if self.path.is_file():
            digest = sha256_memo(self.path)
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"no *.safetensors files in {self.path}")
            digest = hashlib.sha256(b"".join(sha256_memo(f).encode() for f in files)).hexdigest()
        if self.pinned_sha256 is not None and digest != self.pinned_sha256:
            raise ModelLoadError(f"{self.path} has sha256 {digest}, expected {self.pinned_sha256}; reinstall it")
        return digest

    def float_bytes(self) -> int | None:
        """About what a float32 copy of a GGUF's weights takes in memory (None where unknown)."""
        return None if self.parameters is None else 4 * self.parameters

    def describe(self) -> str:
        """One line: 'qwen2.5-coder-1.5b: a GGUF file (qwen2; Q4_K, Q6_K, F32)'."""
        return f"{self.name}: {FORMATS[self.format]} ({self.family}; {', '.join(self.weights)})"
