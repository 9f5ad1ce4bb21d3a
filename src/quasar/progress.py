"""Progress on stderr for long work: a bar on a terminal; a plain line every 10 s otherwise (a log file, a
job run under nohup), so long runs say how far they are wherever their output goes."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from tqdm.auto import tqdm

Item = TypeVar("Item")
LINE_EVERY_S = 10.0  # without a terminal: how often a progress line is written
IN_NOTEBOOK = any(c.__module__ == "tqdm.notebook" for c in tqdm.__mro__)  # tqdm.auto draws a widget there


def progress(items: Iterable[Item], description: str, total: int | None = None, initial: int = 0) -> Iterator[Item]:
    """items with a bar (count, rate, ETA); `initial` items were done before (a resumed run)."""
    if sys.stderr.isatty() or IN_NOTEBOOK:
        yield from tqdm(items, desc=description, total=total, initial=initial, leave=False, dynamic_ncols=True)
    else:
        yield from lines(items, description, total, initial)


def lines(items: Iterable[Item], description: str, total: int | None = None, initial: int = 0,
          every_s: float = LINE_EVERY_S) -> Iterator[Item]:
    """items, with a line on stderr every `every_s` seconds: the count, the rate and the time left; and where it wrote
    any, a last one when the items are done (how many, in how long), so a log shows where each long phase ended."""
    start = last = time.monotonic()
    done, wrote = 0, False
    for item in items:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            last, wrote = now, True
            print(f"{description}: {status(initial + done, total, done / (now - start))}", file=sys.stderr, flush=True)
    if wrote:
        finished(description, initial + done, time.monotonic() - start)


def finished(description: str, count: int, seconds: float, unit: str = "") -> None:
    """The closing line of a phase that wrote progress lines: 'description: done, 250 in 41 s'."""
    unit = f" {unit}" if unit else ""
    print(f"{description}: done, {count}{unit} in {seconds:.0f} s", file=sys.stderr, flush=True)


def status(count: int, total: int | None, per_s: float, unit: str = "") -> str:
    """'53/250 (21%), 9.1/min, about 22 min left'; without a total, the count and the rate."""
    unit = f" {unit}" if unit else ""
    rate = f"{per_s:.2f}{unit}/s" if per_s >= 1 else f"{per_s * 60:.1f}{unit}/min"
    if not total:
        return f"{count} done, {rate}"
    left_s = (total - count) / per_s if per_s > 0 else float("inf")
    left = f"{left_s:.0f} s" if left_s < 120 else f"{left_s / 60:.0f} min"
    return f"{count}/{total} ({100 * count / total:.0f}%), {rate}, about {left} left"


@contextmanager
def polled(description: str, total: int, count: Callable[[], int], unit: str = "") -> Iterator[None]:
    """Progress of one blocking call that reports none of its own (a compile, a copy another library writes):
    count() is asked twice a second how far it is (of `total`), for a bar on a terminal or a line every
    LINE_EVERY_S seconds otherwise."""
    terminal = sys.stderr.isatty() or IN_NOTEBOOK
    bar = tqdm(total=total, desc=description, unit=unit or "it", leave=False, dynamic_ncols=True,
               disable=not terminal)
    done = threading.Event()

    def tick() -> None:
        start = last = time.monotonic()
        wrote = False
        while not done.wait(0.5):
            n = min(count(), total)
            bar.n = n
            bar.refresh()
            now = time.monotonic()
            if not terminal and now - last >= LINE_EVERY_S:
                last, wrote = now, True
                print(f"{description}: {status(n, total, n / (now - start), unit)}", file=sys.stderr, flush=True)
        if wrote:
            finished(description, min(count(), total), time.monotonic() - start, unit)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
        bar.close()
