"""Continuous batching behind the HTTP handlers: one worker thread owns the engine and runs a quasar.decoding.batch
Batch, step after step; requests join it between steps and leave as soon as they finish.

The HTTP handlers (asyncio) submit an engine Request and read its pieces from an asyncio queue; the worker (a
plain thread, because generation is blocking torch code) runs the steps and hands each request's new pieces
over with `call_soon_threadsafe`. A Job is the request and that channel; the scheduler keeps its jobs in a list
and reads everything else off the request: its pieces, whether it ended, its `error`, whether it was `cancelled`.
At most `max_batch` requests run at once (and only as many as the KV budget holds); up to `max_queue` more wait,
and beyond that `submit` raises QueueFullError (HTTP 429). A cancelled job (client gone) leaves the queue at once;
once in the batch, its request is flagged `cancelled` and leaves at the next step, freeing its cache. A request
that fails inside a batch fails alone.

The engine is used under one lock, which the worker holds for each step (the HTTP side encodes prompts with a
tokenizer of its own: quasar.serve.app.PromptEncoder). If the worker thread dies, every job it held fails and
`unavailable` says why.

`drain(seconds)` shuts down gracefully: new requests are refused at once (ShuttingDownError, HTTP 503), the
running and queued ones go on until they finish or the time is up; then those left end with a
ShuttingDownError and `work()` returns.
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
from typing import NamedTuple

from quasar.decoding.batch import Batch
from quasar.decoding.engine import Engine
from quasar.decoding.request import Request
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.processors import TokenLogprob

log = logging.getLogger("quasar")
IDLE_RELEASE_S = 5.0  # idle this long, the worker gives back the memory kept for reuse (KV caches, kernel results)


class QueueFullError(RuntimeError):
    """Every place in the queue is taken; the client should retry later (HTTP 429)."""


class WorkerStoppedError(RuntimeError):
    """The worker thread is gone: this server can generate nothing more (HTTP 503)."""


class ShuttingDownError(WorkerStoppedError):
    """The server is shutting down: it takes no new request, and ends those still running at its deadline."""


class Delta(NamedTuple):
    """What one step added to a request's output: text, and the logprobs of its new tokens (empty unless asked;
    a token's text may come a step after its logprob, once its characters are whole)."""

    text: str
    logprobs: list[TokenLogprob]


@dataclass(eq=False)
class Job:
    """One request: the engine Request to run (which holds its state) and the channel its pieces come back on."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    first_piece: float | None = None

    def emit(self, kind: str, value: object) -> None:
        """Called from the worker thread; a closed loop (its server gone) has no one left to tell."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    async def pieces(self) -> AsyncIterator[Delta]:
        """Text pieces (with their tokens' logprobs, when asked for) as they are generated; raises what the
        generation raised."""
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
        return self.request.output


async def merged(jobs: list[Job]) -> AsyncIterator[tuple[int, Delta | None]]:
    """The pieces of several jobs (a request's choices) as they come, as (job's index, piece), and (index, None)
    when a job ends; raises what a generation raised."""
    queue: asyncio.Queue[tuple[int, Delta | None, Exception | None]] = asyncio.Queue()

    async def forward(i: int, job: Job) -> None:
        try:
            async for delta in job.pieces():
                queue.put_nowait((i, delta, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 (raised to the reader below)
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(forward(i, job)) for i, job in enumerate(jobs)]
    try:
        running = len(jobs)
        while running:
            i, delta, error = await queue.get()
            if error is not None:
                raise error
            running -= delta is None
            yield i, delta
    finally:
        for task in tasks:
            task.cancel()


Finished = Callable[[Job, RequestOutput, bool], None]  # (job, completion, cancelled) -> None


class Scheduler:
    """A worker thread serving submitted requests in continuous batches (see the module doc)."""

    def __init__(self, engine: Engine, max_queue: int = 64, max_batch: int = 16, max_rows: int = 64,
                 kv_budget: int | None = None, on_finish: Finished | None = None, own_thread: bool = True) -> None:
        """own_thread=False: the caller runs `work()` on a thread of its own, the one that loaded the model (see
        `work`)."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.batch = Batch(engine, max_batch, max_rows, kv_budget)
        self._jobs: list[Job] = []  # every job submitted and not yet ended, in order
        self._incoming: deque[Job] = deque()  # submitted, not yet handed to the batch
        self._cond = threading.Condition()
        self._stopped = False
        self._deadline: float | None = None  # draining: when the requests still running are ended
        self._failure: str | None = None  # why the worker thread died
        self._engine_lock = threading.Lock()
        self._busy_since_release = False  # steps ran since the kept memory was last given back
        if own_thread:
            self._thread = threading.Thread(target=self.work, name="quasar-worker", daemon=True)
            self._thread.start()
        else:
            self._thread = threading.current_thread()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet generating."""
        return len(self._incoming) + len(self.batch.waiting)

    @property
    def running(self) -> int:
        return len(self.batch.active)

    @property
    def unavailable(self) -> str | None:
        """Why no request can be served any more; None while the worker runs."""
        if self._failure is not None:
            return f"the generation worker stopped: {self._failure}"
        if self._deadline is not None:
            return "the server is shutting down"
        if self._stopped or not self._thread.is_alive():
            return "the generation worker has been stopped"
        return None

    def submit(self, request: Request) -> Job:
        job = Job(request, asyncio.get_running_loop())
        with self._cond:
            if self._deadline is not None:
                raise ShuttingDownError("the server is shutting down; it takes no new requests")
            if self.unavailable is not None:
                raise WorkerStoppedError(self.unavailable)
            if self.waiting >= self.max_queue:
                raise QueueFullError(f"the server is busy: {self.waiting} requests are already waiting")
            self._jobs.append(job)
            self._incoming.append(job)
            self._cond.notify()
        return job

    def cancel(self, job: Job) -> None:
        """The client went away: free its place in the queue now, or its slot in the batch at the next step (the
        batch drops a request flagged `cancelled`)."""
        with self._cond:
            if job.request.cancelled or job not in self._jobs:
                return  # already ended
            job.request.cancelled = True
            if job in self._incoming:
                self._incoming.remove(job)
                self._jobs.remove(job)
                if self.on_finish is not None:  # counted as cancelled, though it never ran
                    self.on_finish(job, job.request.output, True)
                job.emit("done", None)
            else:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def drain(self, seconds: float) -> None:
        """Take no new request; let the others run for at most `seconds`, then end them (see the module doc)."""
        with self._cond:
            if self._deadline is None:
                self._deadline = time.monotonic() + seconds
            self._cond.notify()

    def work(self) -> None:
        """Serve until `stop()`. Best on the thread that loaded the model: every thread that runs torch's
        parallel kernels keeps an OpenMP thread pool, and with two pools on the machine's cores libgomp stops
        spinning between parallel regions (measured here: a forward of the default model 4.1 ms on the
        loading thread, 11.6 ms on another one)."""
        try:
            while self._next():
                with self._engine_lock:
                    self.batch.step()
                self._deliver()
            self._end_all(ShuttingDownError("the server is shutting down"))
        except BaseException as e:  # not a failed generation (those fail their request): the thread ends here
            log.critical("the generation worker stopped", exc_info=True)
            self._abandon(f"{type(e).__name__}: {e}")

    def _next(self) -> bool:
        """Wait for work and hand new jobs to the batch. False once stopped."""
        idle_since = time.monotonic()
        with self._cond:
            while not self._incoming and self.batch.idle and not self._stopped:
                if self._deadline is not None:
                    return False  # drained
                self._cond.wait(timeout=1.0)  # a timeout lets a signal handler on this thread run
                if self._busy_since_release and time.monotonic() - idle_since >= IDLE_RELEASE_S:
                    self._release_memory()  # idle: the memory a busy spell kept goes back to the system
            if self._stopped or (self._deadline is not None and time.monotonic() >= self._deadline):
                return False
            incoming, self._incoming = list(self._incoming), deque()
            self._busy_since_release = True
        for job in incoming:
            try:
                self.batch.add(job.request)
            except ValueError as e:  # more KV positions than the whole budget: it could never run
                self._end(job, error=e)
        return True

    def _deliver(self) -> None:
        """Each job's new pieces to its client; the jobs whose requests ended (done, failed or cancelled) end."""
        with self._cond:
            jobs = list(self._jobs)
        for job in jobs:
            request = job.request
            pieces, logprobs = request.take(), request.take_logprobs()
            if pieces and job.first_piece is None:
                job.first_piece = time.perf_counter()
            if logprobs and not pieces:
                pieces = [""]  # logprobs of tokens whose text is not whole yet
            for i, piece in enumerate(pieces):  # the step's logprobs go with its last piece
                job.emit("piece", Delta(piece, logprobs if i == len(pieces) - 1 else []))
            if request.finished:
                self._end(job, request.error)

    def _end(self, job: Job, error: BaseException | None = None) -> None:
        with self._cond:
            if job not in self._jobs:
                return
            self._jobs.remove(job)
        if error is not None:
            job.emit("error", error)
            return
        if self.on_finish is not None:
            self.on_finish(job, job.request.output, job.request.cancelled)
        job.emit("done", None)

    def _release_memory(self) -> None:
        """Drop the KV caches kept for prefix caching and give kept memory back (runs with the condition held,
        between steps)."""
        from quasar.kernels import native

        self._busy_since_release = False
        with self._engine_lock:
            caches = self.batch.engine.caches
            kept = caches.kept
            caches.free.clear()
            released = native.release_memory()
        log.info("idle: gave back %d kept KV positions and %.0f MB of kernel results", kept, released / 2**20)

    def _end_all(self, error: BaseException) -> None:
        """End every job still queued or running with `error` (the server stops), freeing their caches."""
        with self._cond:
            jobs = list(self._jobs)
            self._incoming.clear()
        with self._engine_lock:
            for job in jobs:
                if job.request in self.batch.active or job.request in self.batch.waiting:
                    self.batch.cancel(job.request)
        for job in jobs:
            self._end(job, error=error)

    def _abandon(self, failure: str) -> None:
        """Fail every job: no one else will run them."""
        with self._cond:
            self._failure = failure
            jobs = list(self._jobs)
            self._jobs.clear()
            self._incoming.clear()
        for job in jobs:
            running = job.request.cache is not None
            job.emit("error", RuntimeError(f"generation failed: {failure}") if running
                     else WorkerStoppedError(self.unavailable))
