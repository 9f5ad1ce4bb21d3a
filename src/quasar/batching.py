"""Continuous batching: the requests in flight share each forward of the target model.

Every step, each active request contributes the forward its decoder waits for (a verify step's
[last, *draft] rows, a decode row, or the next chunk of its prompt); one forward runs all those rows, each
request attending over its own KV cache; then each request's decoder judges its rows, trims its cache and
emits its tokens. Requests join between steps while the batch has room (`max_batch` requests, KV
positions within the cache pool's budget) and leave as soon as they finish or are cancelled.

Same answers as alone: on quasar's kernels every row is computed from its own input only, so a request's
logits are bitwise those it gets alone, whatever else is in the batch, and prompts can be prefilled in
chunks. A forward holds at most `max_rows` rows: each request's first row always runs; draft rows beyond
the budget are cut (the shorter draft is still a valid draft, so output is unchanged at temperature 0 and
its distribution unchanged otherwise), except for seeded sampled requests, which must draw as they would
alone; prompt chunks fill what is left. On the torch path (CUDA, fp32) rows are not independent of their
neighbours, so each request gets a forward of its own, prompts whole: the same answers, without the gain.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from quasar.engine import Engine, Request
from quasar.models.llama import Step

log = logging.getLogger("quasar")

MIN_CHUNK = 32  # prompt tokens a waiting prefill gets per step even when the decoding rows fill the budget


class Batch:
    """Requests served together by one engine: `add` them, call `step` until `idle`."""

    def __init__(self, engine: Engine, max_batch: int = 16, max_rows: int = 64, kv_budget: int | None = None) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if kv_budget is not None and kv_budget < 1:
            raise ValueError(f"the KV budget must be a positive number of tokens, got {kv_budget}")
        self.engine, self.max_batch, self.max_rows = engine, max_batch, max_rows
        engine.caches.budget, engine.caches.spare = kv_budget, max_batch
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []
        self.failures: dict[int, BaseException] = {}  # id(request) -> what made it fail

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.active

    def add(self, request: Request) -> None:
        """Queue a request (from Engine.request); it starts at a step with room for it."""
        budget = self.engine.caches.budget
        if budget is not None and request.cache_len > budget:
            raise ValueError(f"the request needs {request.cache_len} KV positions; the KV budget is {budget}")
        self.waiting.append(request)

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away): it leaves the batch now and its cache is freed."""
        if request in self.waiting:
            self.waiting.remove(request)
        request.finish()
        self.retire([request])

    def step(self) -> list[Request]:
        """Admit what fits, run one forward over every active request's rows, advance each request; returns
        the requests that finished in this step (done, failed or cancelled; see `failures`)."""
        self.admit()
        steps = self.plan()
        if steps:
            requests = list(steps)
            for request, logits in zip(requests, self.forward(requests, list(steps.values()))):
                if logits is None:
                    continue
                whole = request.step
                if whole is not None and len(steps[request].tokens) < len(whole.tokens) and whole.last_only:
                    request.step = whole._replace(tokens=whole.tokens[len(steps[request].tokens):])  # prompt left
                    continue
                self.guarded(request, request.advance, logits)
        done = [r for r in self.active if r.finished]
        self.retire(done)
        return done

    def admit(self) -> None:
        caches = self.engine.caches
        while self.waiting and len(self.active) < self.max_batch and caches.fits(self.waiting[0].cache_len):
            request = self.waiting.popleft()
            self.active.append(request)
            self.guarded(request, request.begin, caches.take(request.cache_len))

    def plan(self) -> dict[Request, Step]:
        """The rows each request runs in this step: every decode step's first row; the uncut steps whole; draft
        rows of the others one depth at a time while the budget lasts; then prompt chunks."""
        decoding = [r for r in self.active if r.step is not None and not r.step.last_only]
        prefilling = [r for r in self.active if r.step is not None and r.step.last_only]
        if not self.engine.target.model.batches_rows:  # one forward per request anyway: nothing to share or cut
            return {r: r.step for r in decoding + prefilling}  # type: ignore[misc]
        rows = {r: (1 if r.step.cut else len(r.step.tokens)) for r in decoding}  # type: ignore[union-attr]
        spare = self.max_rows - sum(rows.values())
        depth = 1
        while spare > 0:
            deeper = [r for r in decoding if r.step.cut and len(r.step.tokens) > depth]  # type: ignore[union-attr]
            for request in deeper[:spare]:
                rows[request] += 1
            spare -= min(spare, len(deeper))
            if not deeper:
                break
            depth += 1
        plan = {r: r.step._replace(tokens=r.step.tokens[: rows[r]]) for r in decoding}  # type: ignore[union-attr]
        for i, request in enumerate(prefilling):
            chunk = max(spare, MIN_CHUNK) if i == 0 else spare
            if chunk <= 0:
                break
            plan[request] = request.step._replace(tokens=request.step.tokens[:chunk])  # type: ignore[union-attr]
            spare -= len(plan[request].tokens)
        return plan

    def forward(self, requests: list[Request], steps: list[Step]) -> list[torch.Tensor | None]:
        """Logits for each step: one forward over all; if that fails, each alone (from the same cache
        lengths), so that only the request at fault fails."""
        model = self.engine.target.model
        lengths = [step.cache.length for step in steps]
        with torch.inference_mode():
            try:
                return list(model.forward_steps(steps))
            except Exception as e:  # noqa: BLE001 (whatever failed, retried one by one below)
                if len(steps) == 1:
                    self.fail(requests[0], e)
                    return [None]
                log.warning("a batched forward failed (%s); running its %d requests one by one", e, len(steps))
            out: list[torch.Tensor | None] = []
            for request, step, length in zip(requests, steps, lengths):
                step.cache.trim(step.cache.length - length)
                try:
                    out.append(model.forward_steps([step])[0])
                except Exception as e:  # noqa: BLE001 (fails this request alone)
                    self.fail(request, e)
                    out.append(None)
            return out

    def guarded(self, request: Request, action, *args) -> None:
        """request.begin or .advance; what it raises fails that request alone."""
        try:
            action(*args)
        except Exception as e:  # noqa: BLE001 (fails this request alone)
            self.fail(request, e)

    def fail(self, request: Request, error: BaseException) -> None:
        log.error("a request failed: %s: %s", type(error).__name__, error)
        self.failures[id(request)] = error
        request.finish()

    def retire(self, done: list[Request]) -> None:
        for request in done:
            if request in self.active:
                self.active.remove(request)
                if request.cache is not None:
                    self.engine.caches.give(request.cache)

    def run_all(self, requests: list[Request]) -> None:
        """Serve these requests to the end (the Python API's batched generate); re-raises the first failure."""
        for request in requests:
            self.add(request)
        while not self.idle:
            self.step()
        for request in requests:
            if id(request) in self.failures:
                raise self.failures.pop(id(request))
