"""The FastAPI app: OpenAI routes over continuously batched engine requests, a bounded queue, metrics, API-key check."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quasar.decoding.engine import Engine
from quasar.decoding.outputs import RequestOutput
from quasar.serve.metrics import Metrics
from quasar.serve.protocol import BadRequest, ChatRequest, CompletionRequest, Envelope, budget, error_body, parse
from quasar.serve.scheduler import Job, QueueFullError, Scheduler, WorkerStoppedError

log = logging.getLogger("quasar")


class AuthMiddleware:
    """ASGI middleware: bearer-token check on /v1/* and a request counter by route and status.

    The route label is one of the app's `endpoints`, or 'other': a client cannot add label values.
    Plain ASGI (not BaseHTTPMiddleware) so that a client disconnect reaches the streaming response."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics, endpoints: frozenset[str]) -> None:
        self.app, self.api_key, self.metrics, self.endpoints = app, api_key, metrics, endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        if self.api_key and path.startswith("/v1") and not self._authorized(scope):
            body = error_body("missing or invalid API key (send 'Authorization: Bearer KEY')", code="invalid_api_key")
            return await JSONResponse(body, status_code=401)(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_queue: int = 64, max_batch: int = 16,
               max_rows: int = 64, kv_budget: int | None = None, own_thread: bool = True) -> FastAPI:
    """The app over `engine`: up to `max_batch` requests share each forward (at most `max_rows` rows, KV caches
    within `kv_budget` positions), `max_queue` more wait (quasar.serve.scheduler). With own_thread=False the
    caller runs `app.state.scheduler.work()` (quasar serve does, on the thread that loaded the model)."""
    metrics = Metrics()

    def finished(job: Job, completion: RequestOutput, cancelled: bool) -> None:
        first = None if job.first_piece is None else job.first_piece - job.submitted
        metrics.record(completion.stats, time.perf_counter() - job.submitted, first, cancelled)

    scheduler = Scheduler(engine, max_queue, max_batch, max_rows, kv_budget, on_finish=finished, own_thread=own_thread)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.stop()

    app = FastAPI(title="quasar", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.kind, e.param, e.code), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(WorkerStoppedError)
    async def unavailable(_: Request, e: WorkerStoppedError) -> JSONResponse:
        return JSONResponse(error_body(str(e), "server_error", code="worker_stopped"), status_code=503)

    @app.exception_handler(Exception)
    async def server_error(_: Request, e: Exception) -> JSONResponse:
        log.exception("request failed")
        return JSONResponse(error_body(f"internal error: {e}", "server_error"), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok", "model": model_name, "queue_length": scheduler.waiting}
        if scheduler.unavailable is not None:
            return JSONResponse(body | {"status": "unavailable", "reason": scheduler.unavailable}, status_code=503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(scheduler.waiting, scheduler.running)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "quasar",
                "max_model_len": engine.max_context}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = parse(CompletionRequest, await read_json(request))
        check_model(req.model)
        return await serve(req, await completion_ids(req), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = parse(ChatRequest, await read_json(request))
        check_model(req.model)
        try:
            ids = await scheduler.call(engine.encode, [m.text() for m in req.messages])
        except ValueError as e:
            raise BadRequest(str(e), param="messages") from None
        return await serve(req, ids, chat=True)

    def check_model(name: str) -> None:
        if name != model_name:
            raise BadRequest(f"the model {name!r} does not exist; this server serves {model_name!r}",
                             param="model", code="model_not_found")

    async def completion_ids(req: CompletionRequest) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            if not all(0 <= t < engine.target.model.config.vocab_size for t in prompt):
                raise BadRequest("prompt token id out of range", param="prompt")
            return list(prompt)  # type: ignore[arg-type]
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise BadRequest("exactly one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("the prompt is empty", param="prompt")
        return await scheduler.call(engine.encode, str(prompt), False)

    async def serve(req: CompletionRequest | ChatRequest, ids: list[int], chat: bool) -> Any:
        requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
        room = budget(requested, len(ids), engine.max_context)
        try:
            request = engine.request(ids, req.sampling(room))
        except ValueError as e:
            raise BadRequest(str(e)) from None
        try:
            job = scheduler.submit(request)
        except QueueFullError as e:
            raise BadRequest(str(e), status=429, kind="rate_limit_exceeded", code="queue_full") from None
        envelope = Envelope(model_name, chat)
        if req.stream:
            return StreamingResponse(sse(job, envelope, req.include_usage), media_type="text/event-stream")
        try:
            completion = await job.completion()
        finally:
            scheduler.cancel(job)  # no-op once finished; frees the place if this handler was cancelled
        return JSONResponse(envelope.full(completion))

    async def sse(job: Job, envelope: Envelope, include_usage: bool) -> AsyncIterator[str]:
        try:
            role = envelope.chat  # the chat's role chunk goes out with the first text, as vLLM's does: a client
            try:  # that times its first chunk (vLLM's benchmark does) then measures the prefill, not the queue
                async for piece in job.pieces():
                    if role:
                        yield event(envelope.chunk(None, role=True))
                        role = False
                    yield event(envelope.chunk(piece))
                if role:
                    yield event(envelope.chunk(None, role=True))
            except Exception as e:  # generation failed after the 200 went out: say so in the stream
                yield event(error_body(f"generation failed: {e}", "server_error"))
                return
            completion = job.request.output
            yield event(envelope.chunk(None, finish_reason=completion.finish_reason))
            if include_usage:
                yield event(envelope.usage_chunk(completion))
            yield "data: [DONE]\n\n"
        finally:
            scheduler.cancel(job)  # the client went away mid-stream: stop generating, free the place

    app.add_middleware(AuthMiddleware, api_key=api_key, metrics=metrics, endpoints=frozenset(r.path for r in app.routes))
    return app


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
