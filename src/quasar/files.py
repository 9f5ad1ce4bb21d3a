"""File helpers every layer needs, in one leaf module (it imports nothing from quasar): the cache folder (process
configuration, set once), sha256 (memoised by path, size and mtime), atomic files and directories, and the load error.

Atomic means a reader, or a re-run after a crash (even SIGKILL), sees the old content or the new content,
never a half-written one: everything is written into a temporary sibling and renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


class ModelLoadError(ValueError):
    """A model path that cannot be loaded; the message says why and what to do."""


_cache_dir: Path | None = None  # the process's cache folder, where use_cache_dir set one


def use_cache_dir(path: str | Path | None) -> Path | None:
    """Set the folder every later cache read and write of this process uses (the CLI's --cache-dir, the API's
    cache_dir=); None: the user cache again. Returns the folder set before."""
    global _cache_dir
    previous, _cache_dir = _cache_dir, None if path is None else Path(path).expanduser()
    return previous


def cache_root() -> Path:
    """The cache: the folder use_cache_dir set, else $XDG_CACHE_HOME/quasar, else ~/.cache/quasar."""
    if _cache_dir is not None:
        return _cache_dir
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quasar"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_memo(path: Path) -> str:
    """sha256_file(path), remembered in the cache under the file's (absolute path, size, mtime): a file that
    changes gets a new entry, so a memo can be stale only if a file is rewritten with its old size and mtime."""
    stat = path.stat()
    identity = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    memo = cache_root() / "sha256" / f"{hashlib.sha256(identity).hexdigest()[:32]}.json"
    try:
        return json.loads(memo.read_text())["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    digest = sha256_file(path)
    try:
        atomic_write_text(memo, json.dumps({"path": str(path.resolve()), "sha256": digest}))
    except OSError:  # a read-only cache: still correct, only slower next time
        pass
    return digest


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


UMASK = _read_umask()  # read once, at import: os.umask is process-wide and setting it is not thread-safe


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path via a temporary sibling, flushed to disk, then renamed over path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~UMASK)  # mkstemp makes 0600; a report is as readable as any file
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_directory(target: Path, write: Callable[[Path], None], replace: bool = True) -> Path:
    """Run write(tmp) in a temporary sibling of target, then rename it into place.

    replace=False is for caches keyed by their content: when another process finished the same target
    first, its copy is kept (readers of it are never disturbed) and ours is dropped. replace=True moves an
    existing target aside with one rename before ours takes its place, so target is never missing parts."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp.", dir=target.parent))
    os.chmod(tmp, 0o777 & ~UMASK)  # mkdtemp makes 0700; the result is as readable as any directory
    old = None
    try:
        write(tmp)
        if target.exists():
            if not replace:
                return target
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, old / "dir")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target.exists() and not replace):  # lost a race to an identical cache entry: keep it
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return target

