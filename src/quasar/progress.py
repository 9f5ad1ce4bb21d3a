"""Progress bars on stderr for long work (hidden when stderr is not a terminal)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

Item = TypeVar("Item")


def progress(items: Iterable[Item], description: str, total: int | None = None) -> Iterator[Item]:
    yield from tqdm(items, desc=description, total=total, disable=None, leave=False, dynamic_ncols=True)
