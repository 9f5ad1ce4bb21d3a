"""A bounded FIFO of requests served one at a time by one worker thread that owns the engine.

The HTTP handlers (asyncio) submit a Run and read its pieces from an asyncio queue; the worker
(a plain thread, because generation is blocking torch code) iterates the Run and hands the pieces
over with `call_soon_threadsafe`. A cancelled job (client gone) leaves the queue at once, or, when
it is running, stops after the piece being computed, and its Run is closed.

The engine (its model and its Rust-backed tokenizer, which fails with "Already borrowed" when two threads
use it at once) is used under one lock: the worker holds it for each generation step, the handlers for
each `call` (prompt encoding). If the worker thread dies, every job it held fails and `unavailable` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from quasar.engine import Run
from quasar.outputs import RequestOutput

log = logging.getLogger("quasar")
T = TypeVar("T")


class QueueFullError(RuntimeError):
    """Every place in the queue is taken; the client should retry later (HTTP 429)."""


class WorkerStoppedError(RuntimeError):
    """The worker thread is gone: this server can generate nothing more (HTTP 503)."""


@dataclass
class Job:
    """One request: the Run to execute and the channel its pieces come back on."""

    run: Run
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)
    first_piece: float | None = None

    def emit(self, kind: str, value: object) -> None:
        """Called from the worker thread; a closed loop (its server gone) has no one left to tell."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    async def pieces(self) -> AsyncIterator[str]:
        """Text pieces as they are generated; raises what the generation raised."""
        while True:
            kind, value = await self.events.get()
            if kind == "piece":
                yield value  # type: ignore[misc]
            elif kind == "error":
                raise value  # type: ignore[misc]
            else:
                return

    async def completion(self) -> RequestOutput:
        async for _ in self.pieces():
            pass
        return self.run.output


Finished = Callable[[Job, RequestOutput, bool], None]  # (job, completion, cancelled) -> None


class Scheduler:
    """At most `max_queue` jobs wait while one runs; `submit` raises QueueFullError beyond that."""

    def __init__(self, max_queue: int, on_finish: Finished | None = None) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.on_finish = on_finish
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._stopped = False
        self._failure: str | None = None  # why the worker thread died
        self._engine_lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name="quasar-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    @property
    def unavailable(self) -> str | None:
        """Why no request can be served any more; None while the worker runs."""
        if self._failure is not None:
            return f"the generation worker stopped: {self._failure}"
        if self._stopped or not self._thread.is_alive():
            return "the generation worker has been stopped"
        return None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a helper thread, between two generation steps, never during one (see the module doc)."""

        def locked() -> T:
            with self._engine_lock:
                return fn(*args)

        return await asyncio.to_thread(locked)

    def submit(self, run: Run) -> Job:
        job = Job(run, asyncio.get_running_loop())
        with self._cond:
            if self.unavailable is not None:
                raise WorkerStoppedError(self.unavailable)
            if len(self._waiting) >= self.max_queue:
                raise QueueFullError(f"the server is busy: {len(self._waiting)} requests are already waiting")
            self._waiting.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: free its place, or stop its generation after the current step."""
        with self._cond:
            job.cancelled.set()
            if job in self._waiting:
                self._waiting.remove(job)
                job.emit("done", None)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _next(self) -> Job | None:
        with self._cond:
            while not self._waiting and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            self._running = self._waiting.popleft()
            return self._running

    def _work(self) -> None:
        try:
            while (job := self._next()) is not None:
                self._execute(job)
                with self._cond:
                    self._running = None
        except BaseException as e:  # not a failed generation (those fail their request): the thread ends here
            log.critical("the generation worker stopped", exc_info=True)
            self._abandon(f"{type(e).__name__}: {e}")

    def _abandon(self, failure: str) -> None:
        """Fail the running job and every waiting one: no one else will run them."""
        with self._cond:
            self._failure = failure
            running, self._running = self._running, None
            waiting = list(self._waiting)
            self._waiting.clear()
        if running is not None:
            running.emit("error", RuntimeError(f"generation failed: {failure}"))
        for job in waiting:
            job.emit("error", WorkerStoppedError(self.unavailable))

    def _execute(self, job: Job) -> None:
        pieces = iter(job.run)
        try:
            while not job.cancelled.is_set():
                with self._engine_lock:
                    piece = next(pieces, None)
                if piece is None:
                    break
                if job.first_piece is None:
                    job.first_piece = time.perf_counter()
                job.emit("piece", piece)
        except Exception as e:  # a failed generation fails its request, not the server
            log.exception("generation failed")
            job.emit("error", e)
            return
        finally:
            with self._engine_lock:
                job.run.close()
        if self.on_finish is not None:
            self.on_finish(job, job.run.output, job.cancelled.is_set())
        job.emit("done", None)
