"""Continuous batching: the requests in flight share each forward of the target model.

Every step, each active request contributes the forward its decoder waits for (a verify step's
[last, *draft] rows, a decode row, or the next chunk of its prompt); one forward runs all those rows, each
request attending over its own KV cache; then each request's decoder judges its rows, trims its cache and
emits its tokens. Requests join between steps while the batch has room (`max_batch` requests, KV
positions within the cache pool's budget) and leave as soon as they finish, fail or are cancelled. Each request
carries its own outcome (quasar.decoding.request.Request: `finished`, `error`, `cancelled`): a request that fails
fails alone, its error on it, and one flagged `cancelled` (by another thread, say) leaves at the next step.

A request alone is a batch of one (Engine.run): it runs each step whole, as its decoder asked for it, with nothing
to share a forward with and no draft row cut.

Same answers as alone: on quasar's kernels every row is computed from its own input only, so a request's
logits are bitwise those it gets alone, whatever else is in the batch, and prompts can be prefilled in
chunks.

Rows: a forward holds at most `max_rows`. Each request's first row always runs. Draft rows are added in order
of their chance of acceptance (from each decoder's recent acceptance at each draft position) while they
pay for themselves: past ~8 rows a CPU forward costs about linearly more per row, so a row is added only if
its expected tokens raise the forward's tokens per second under a cost model fitted on the recent forwards
(CostModel). With few requests in the batch nearly every draft pays; in a full batch only the likely ones do. A cut draft is still a
valid draft (output unchanged at temperature 0, and when sampling a free drafter's deterministic draft, whose
tokens are matched against plain decoding's draws; a distribution unchanged otherwise), but it changes which
random numbers a request draws whose drafts draw them (a model drafter's, a cascade's, a guarded one's), so such a
request keeps its whole draft when seeded. Prompt chunks
come before drafts (they are certain work), at least MIN_CHUNK tokens a step. On the torch path (CUDA, fp32)
rows are not independent of their neighbours, so each request gets a forward of its own, prompts whole: the same
answers, without the gain.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import torch

from quasar.decoding.costs import CostModel
from quasar.decoding.request import Host, Request
from quasar.decoding.step import Step, run_steps

log = logging.getLogger("quasar")

MIN_CHUNK = 32  # prompt tokens a waiting prefill gets per step even when the decoding rows fill the budget


def worth(step: Step) -> tuple[float, ...]:
    """The chance that each row after a step's first is of use, non-increasing (a prefix is what gets cut)."""
    chances = list(step.chances[: len(step.tokens) - 1]) + [1.0] * (len(step.tokens) - 1 - len(step.chances))
    for i in range(1, len(chances)):
        chances[i] = min(chances[i], chances[i - 1])
    return tuple(chances)


class Batch:
    """Requests served together by one engine: `add` them, call `step` until `idle`; `close` when done.

    The batch sets the engine's cache pool to its KV budget, keeping a spare cache per place, and `close` gives the pool
    back its settings; configure_pool=False leaves the pool as it is (a lone run borrows it)."""

    def __init__(self, engine: Host, max_batch: int = 16, max_rows: int = 64, kv_budget: int | None = None,
                 configure_pool: bool = True) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if kv_budget is not None and kv_budget < 1:
            raise ValueError(f"the KV budget must be a positive number of tokens, got {kv_budget}")
        self.engine, self.max_batch, self.max_rows = engine, max_batch, max_rows
        self.cost = CostModel()
        caches = engine.caches
        self.pool_settings = caches.configure(kv_budget, max_batch) if configure_pool else (caches.budget, caches.spare)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []

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
        """Stop a request (its client went away): it leaves the batch now, flagged `cancelled` unless it had already
        ended, and its cache is freed."""
        if not request.finished:
            request.cancelled = True
            request.finish()
        if request in self.waiting:
            self.waiting.remove(request)
        self.retire([request])

    def step(self) -> list[Request]:
        """Drop the requests flagged `cancelled`, admit what fits, run one forward over every active request's rows,
        advance each request; returns the requests that ended in this step (done, failed or cancelled: each says
        which)."""
        cancelled = [r for r in (*self.waiting, *self.active) if r.cancelled]
        for request in cancelled:
            self.cancel(request)
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
        return cancelled + done if cancelled else done

    def admit(self) -> None:
        """Start the waiting requests that fit, in order. One whose prompt an active request is prefilling waits for
        that prefill, then starts from its cache (a copy of all of the prompt but its last token): the `n` choices
        of one prompt prefill it once."""
        caches = self.engine.caches
        while self.waiting and len(self.active) < self.max_batch and caches.fits(self.waiting[0].cache_len):
            if self.prefilling(self.waiting[0].output.prompt_token_ids):
                return
            request = self.waiting.popleft()
            self.active.append(request)
            in_use = [r.cache for r in self.active if r.cache is not None]
            cache = caches.take(request.cache_len, request.output.prompt_token_ids, in_use)
            self.guarded(request, request.begin, cache)

    def prefilling(self, prompt: list[int]) -> bool:
        """Whether an active request is prefilling this very prompt, on a model whose caches can share prefixes."""
        return self.engine.target.model.plan.batches_rows and any(
            r.step is not None and r.step.last_only and r.output.prompt_token_ids == prompt for r in self.active)

    def plan(self) -> dict[Request, Step]:
        """The rows each request runs in this step: every decode step's first row and the uncut steps whole, then
        prompt chunks, then draft rows in order of their chance of acceptance while they pay for themselves. A batch
        of one, or one on the torch path (a forward per request anyway), has nothing to share or cut: each step runs
        whole."""
        if self.max_batch == 1 or not self.engine.target.model.plan.batches_rows:
            return {r: r.step for r in self.active if r.step is not None}
        decoding = [r for r in self.active if r.step is not None and not r.step.last_only]
        prefilling = [r for r in self.active if r.step is not None and r.step.last_only]
        rows = {r: (1 if r.step.cut else len(r.step.tokens)) for r in decoding}  # type: ignore[union-attr]
        drafts = sorted(((chance, depth, i, r) for i, r in enumerate(decoding) if r.step.cut  # type: ignore[union-attr]
                         for depth, chance in enumerate(worth(r.step), 1)), key=lambda d: (-d[0], d[1], d[2]))
        plan: dict[Request, Step] = {}
        used = sum(rows.values())
        for i, request in enumerate(prefilling):  # prompt rows are certain work: before uncertain drafts
            chunk = max(self.max_rows - used, MIN_CHUNK) if i == 0 else self.max_rows - used
            if chunk <= 0:
                break
            plan[request] = request.step.prefix(chunk)  # type: ignore[union-attr]
            used += len(plan[request].tokens)
        tokens = float(len(decoding) + len(plan))
        for value, _, _, request in drafts:
            if used >= self.max_rows or not self.cost.pays(value, tokens, used):
                break
            rows[request] += 1
            used, tokens = used + 1, tokens + value
        plan.update({r: r.step.prefix(rows[r]) for r in decoding})  # type: ignore[union-attr]
        return plan

    def forward(self, requests: list[Request], steps: list[Step]) -> list[torch.Tensor | None]:
        """Logits for each step: one forward over all; if that fails, each alone (from the same cache
        lengths), so that only the request at fault fails."""
        model = self.engine.target.model
        lengths = [step.cache.length for step in steps]
        with torch.inference_mode():
            try:
                start = time.perf_counter()
                logits = list(run_steps(model, steps))
                rows, seconds = sum(len(step.tokens) for step in steps), time.perf_counter() - start
                self.cost.add(rows, seconds)
                for step in steps:
                    if step.timed is not None:
                        step.timed(rows, seconds)
                return logits
            except Exception as e:  # noqa: BLE001 (whatever failed, retried one by one below)
                if len(steps) == 1:
                    self.fail(requests[0], e)
                    return [None]
                log.warning("a batched forward failed (%s); running its %d requests one by one", e, len(steps))
            out: list[torch.Tensor | None] = []
            for request, step, length in zip(requests, steps, lengths):
                step.cache.trim(step.cache.length - length)
                try:
                    out.append(run_steps(model, [step])[0])
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
        request.error = error
        request.finish()

    def retire(self, done: list[Request]) -> None:
        for request in done:
            if request in self.active:
                self.active.remove(request)
                if request.cache is not None:
                    self.engine.caches.give(request.cache)

    def close(self) -> None:
        """Give the engine's cache pool back its settings from before this batch (its spare caches beyond go)."""
        self.engine.caches.configure(*self.pool_settings)

    def run_all(self, requests: list[Request]) -> None:
        """Serve these requests to the end (the Python API's batched generate); re-raises the first failure."""
        for request in requests:
            self.add(request)
        while not self.idle:
            self.step()
        for request in requests:
            if request.error is not None:
                raise request.error
