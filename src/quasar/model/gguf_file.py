"""A GGUF file read as quasar needs it: its key-value header and its tensor table, the tensors as views of one
read-only mapping of the file.

The gguf package's reader parses every array in the header into Python objects; a 150k-token vocabulary and its
merges take seconds and about 220 MB that stay with the reader. Here arrays are skipped (their length kept): the
tokenizer is converted once by transformers and cached, and nothing else reads them. So reading a header takes about
0.1 s, and a model that computes on the file's blocks holds the mapping and the tensor table, nothing more.

    header = read_gguf_header(path)      # fields and tensor table only (no numpy, no gguf import)
    file = GGUFFile.open(path)           # the same, with each tensor's data as a numpy view of the mapping
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quasar.files import ModelLoadError

SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class ArrayField:
    """A header array, skipped: its element type and length."""

    item_type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    """One row of the tensor table: dims in GGUF order (the row length first), GGML type, offset in the data."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass
class GGUFHeader:
    fields: dict[str, Any]  # scalars and strings as values; arrays as ArrayField
    tensors: list[TensorInfo]
    data_start: int  # where the tensor data begins (aligned)

    def field(self, key: str, default: Any = None) -> Any:
        value = self.fields.get(key)
        return default if value is None else value

    def array_length(self, key: str) -> int:
        value = self.fields.get(key)
        if not isinstance(value, ArrayField):
            raise ModelLoadError(f"the GGUF has no {key} array")
        return value.length

    @property
    def tensor_types(self) -> Counter[int]:
        return Counter(t.ggml_type for t in self.tensors)

    @property
    def parameters(self) -> int:
        total = 0
        for tensor in self.tensors:
            count = 1
            for d in tensor.dims:
                count *= d
            total += count
        return total


class HeaderReader:
    """Reads little-endian values from a mapped file, one after another."""

    def __init__(self, data: Any) -> None:
        self.data, self.at = data, 0

    def take(self, form: str) -> Any:
        value = struct.unpack_from("<" + form, self.data, self.at)[0]
        self.at += struct.calcsize(form)
        return value

    def string(self) -> str:
        size = self.take("Q")
        self.at += size
        return bytes(self.data[self.at - size : self.at]).decode("utf-8", "replace")

    def value(self, kind: int) -> Any:
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self.take("I"), self.take("Q")
        if item in SCALARS:
            size = count * struct.calcsize(SCALARS[item])
            self.at += size
        else:
            for _ in range(count):
                self.value(item)
        return ArrayField(item, count)

    def tensor(self) -> TensorInfo:
        name = self.string()
        dims = tuple(self.take("Q") for _ in range(self.take("I")))
        return TensorInfo(name, dims, self.take("I"), self.take("Q"))


def read_gguf_header(path: Path) -> GGUFHeader:
    """The key-value pairs (arrays skipped) and the tensor table of the GGUF at path; a corrupt or truncated header
    is a ModelLoadError."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return parse_header(memoryview(data), path)
    except (struct.error, ValueError, OSError) as e:
        raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e


def parse_header(data: memoryview, path: Path) -> GGUFHeader:
    """The header in `data`, which is released on return (the mapping under it can then be closed)."""
    reader = HeaderReader(data)
    try:
        if bytes(data[:4]) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file (no GGUF magic)")
        reader.at = 4
        if reader.take("I") < 2:
            raise ModelLoadError(f"{path} is a GGUF of version 1, which quasar does not read")
        n_tensors, n_fields = reader.take("Q"), reader.take("Q")
        fields = {}
        for _ in range(n_fields):
            key = reader.string()
            fields[key] = reader.value(reader.take("I"))
        tensors = [reader.tensor() for _ in range(n_tensors)]
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        start = -(-reader.at // alignment) * alignment
    finally:
        data.release()
    return GGUFHeader(fields, tensors, start)


@dataclass(frozen=True)
class FileTensor:
    """A tensor of a mapped GGUF, shaped as the gguf package's reader shapes it: `shape` in GGUF order, `data` a
    numpy view (float types as their dtype, [rows, row bytes] uint8 for block types)."""

    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data_offset: int  # from the start of the file
    n_bytes: int
    data: Any  # numpy.ndarray


FLOAT_ITEMS = {"F32": "float32", "F16": "float16", "F64": "float64", "I8": "int8", "I16": "int16", "I32": "int32",
               "I64": "int64"}


@dataclass
class GGUFFile:
    """A GGUF's header and its tensors as views of one read-only mapping (`data`, a numpy memmap of the file)."""

    path: Path
    header: GGUFHeader
    tensors: list[FileTensor]
    data: Any

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        header = read_gguf_header(path)
        mapping = np.memmap(path, mode="r")
        plain = mapping.view(np.ndarray)  # slices of a plain view skip memmap's per-slice bookkeeping
        tensors = []
        try:
            for info in header.tensors:
                kind = GGMLQuantizationType(info.ggml_type)
                block, size = GGML_QUANT_SIZES[kind]
                count = 1
                for d in info.dims:
                    count *= d
                start, n_bytes = header.data_start + info.offset, count * size // block
                if start + n_bytes > len(plain):
                    raise ModelLoadError(f"{path} is truncated: its tensors extend past the end of the file")
                shape = list(reversed(info.dims))
                if kind.name in FLOAT_ITEMS:
                    data = plain[start : start + n_bytes].view(FLOAT_ITEMS[kind.name]).reshape(shape)
                else:
                    data = plain[start : start + n_bytes].reshape(*shape[:-1], shape[-1] // block * size)
                tensors.append(FileTensor(info.name, info.dims, kind, start, n_bytes, data))
        except (ValueError, KeyError) as e:
            raise ModelLoadError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from e
        return cls(path, header, tensors, mapping)

    def field(self, key: str, default: Any = None) -> Any:
        return self.header.field(key, default)
