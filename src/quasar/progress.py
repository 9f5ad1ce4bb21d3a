"""Progress bars on stderr for long work (hidden when stderr is not a terminal)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm.auto import tqdm

Item = TypeVar("Item")


def progress(items: Iterable[Item], description: str, total: int | None = None, initial: int = 0) -> Iterator[Item]:
    """items with a bar (count, rate, ETA); `initial` items were done before (a resumed run)."""
    yield from tqdm(items, desc=description, total=total, initial=initial, disable=None, leave=False, dynamic_ncols=True)


@contextmanager
def timed(description: str, expected_s: float) -> Iterator[None]:
    """A bar for one blocking call that reports no progress of its own (a compile): it fills with the time
    spent against `expected_s` (a measured estimate), so the user sees it move and roughly how long is left."""
    bar = tqdm(total=round(expected_s), desc=description, unit="s", disable=None, leave=False, dynamic_ncols=True,
               bar_format="{desc}: {bar} {n_fmt}/~{total_fmt} s")
    done = threading.Event()

    def tick() -> None:
        start = time.monotonic()
        while not done.wait(0.5):
            bar.n = min(round(time.monotonic() - start), bar.total - 1)
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()
