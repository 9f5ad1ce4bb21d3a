"""A bounded FIFO of requests served one at a time by one worker thread that owns the engine.

The HTTP handlers (asyncio) submit a Run and read its pieces from an asyncio queue; the worker
(a plain thread, because generation is blocking torch code) iterates the Run and hands the pieces
over with `call_soon_threadsafe`. A cancelled job (client gone) leaves the queue at once, or, when
it is running, stops after the piece being computed, and its Run is closed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from quasar.engine import Run
from quasar.outputs import RequestOutput

log = logging.getLogger("quasar")


class QueueFullError(RuntimeError):
    """Every place in the queue is taken; the client should retry later (HTTP 429)."""


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
        """Called from the worker thread."""
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
        self._thread = threading.Thread(target=self._work, name="quasar-worker", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    def submit(self, run: Run) -> Job:
        job = Job(run, asyncio.get_running_loop())
        with self._cond:
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
        while (job := self._next()) is not None:
            try:
                self._execute(job)
            finally:
                with self._cond:
                    self._running = None

    def _execute(self, job: Job) -> None:
        try:
            for piece in job.run:
                if job.cancelled.is_set():
                    break
                if job.first_piece is None:
                    job.first_piece = time.perf_counter()
                job.emit("piece", piece)
        except Exception as e:  # a failed generation fails its request, not the server
            log.exception("generation failed")
            job.emit("error", e)
            return
        finally:
            job.run.close()
        if self.on_finish is not None:
            self.on_finish(job, job.run.output, job.cancelled.is_set())
        job.emit("done", None)
