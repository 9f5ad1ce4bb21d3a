"""The FastAPI app: OpenAI routes over continuously batched engine requests, a bounded queue, metrics, API-key check."""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quasar.decoding.engine import Engine
from quasar.decoding.request import Request as EngineRequest
from quasar.decoding.grammar import GrammarError, grammars_for
from quasar.decoding.outputs import RequestOutput
from quasar.decoding.prompt import encode, renders_tools
from quasar.serve.logprobs import TokenTexts
from quasar.serve.metrics import Metrics
from quasar.serve.errors import BadRequest, error_body
from quasar.serve.protocol import ChatRequest, CompletionRequest, budget, parse
from quasar.serve.responses import Envelope, finish_reason, system_fingerprint
from quasar.serve.scheduler import Job, QueueFullError, Scheduler, ShuttingDownError, WorkerStoppedError, merged
from quasar.serve.tools import ToolPlan, ToolReply

log = logging.getLogger("quasar")
RETRY_AFTER_S = 1  # what a 429 tells a client to wait before trying again
CLIENT_CLOSED = 499  # the status counted for a request whose client hung up before it could be answered (nginx's)
HANG_UP_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class Guard:
    """ASGI middleware in front of every route: the API key (every route but /health), the body limit (HTTP 413
    before a larger body is read) and deadline (HTTP 408 when the body is not in `read_timeout` seconds after its
    headers), and the request counter by route and status, 5xx included (a failure no handler answered becomes a
    500 with a generic message here; the log has the details).

    The route label is one of the app's `endpoints`, or 'other': a client cannot add label values.
    Plain ASGI (not BaseHTTPMiddleware) so that a client disconnect reaches the streaming response."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics, endpoints: frozenset[str],
                 max_body: int, read_timeout: float) -> None:
        self.app, self.api_key, self.metrics, self.endpoints = app, api_key, metrics, endpoints
        self.max_body, self.read_timeout = max_body, read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in self.endpoints else "other"
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.count_request(endpoint, message["status"])
            await send(message)

        async def refuse(status: int, message: str, code: str, headers: dict[str, str] | None = None) -> None:
            body = error_body(message, "server_error" if status >= 500 else "invalid_request_error", code=code)
            await JSONResponse(body, status_code=status, headers=headers)(scope, receive, counting_send)

        if self.api_key and path != "/health" and not self._authorized(scope):
            return await refuse(401, "missing or invalid API key (send 'Authorization: Bearer KEY')", "invalid_api_key")
        too_large = f"the request body is over the server's limit of {self.max_body} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_body:
            return await refuse(413, too_large, "body_too_large", {"Connection": "close"})
        received, more, deadline = 0, True, time.monotonic() + self.read_timeout

        async def bounded_receive() -> Message:  # a body without a length (chunked) is counted as it comes
            nonlocal received, more
            if not more:  # the body is in: what comes next is the client hanging up, whenever it does
                return await receive()
            try:
                # never 0: wait_for would cancel the receive before a chunk already buffered is taken
                message = await asyncio.wait_for(receive(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11
                raise BadRequest(f"the request body did not arrive within {self.read_timeout:g} s", status=408,
                                 code="body_timeout", headers={"Connection": "close"}) from None
            more = message["type"] == "http.request" and message.get("more_body", False)
            received += len(message.get("body", b""))
            if received > self.max_body:
                raise BadRequest(too_large, status=413, code="body_too_large")
            return message

        try:
            await self.app(scope, bounded_receive, counting_send)
        except ClientDisconnect:  # hung up while sending its body (or, answered, mid-stream): nobody to answer
            if not started:
                log.info("client hung up before its request body was in: %s %s", scope["method"], path)
                self.metrics.count_request(endpoint, CLIENT_CLOSED)
        except Exception:
            log.exception("request failed: %s %s", scope["method"], path)
            if not started:
                await refuse(500, "internal server error (the server's log has the details)", "internal_error")

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_queue: int = 64, max_batch: int = 16,
               max_rows: int = 64, kv_budget: int | None = None, own_thread: bool = True,
               max_body: int = 4_000_000, read_timeout: float = 30.0, allow_special_tokens: bool = False) -> FastAPI:
    """The app over `engine`: up to `max_batch` requests share each forward (at most `max_rows` rows, KV caches
    within `kv_budget` positions), `max_queue` more wait (quasar.serve.scheduler). With own_thread=False the
    caller runs `app.state.scheduler.work()` (quasar serve does, on the thread that loaded the model). Prompts
    are encoded with a copy of the tokenizer, outside the engine's lock: a long one never stalls generation. A control
    token's text in a prompt or a message is plain text unless `allow_special_tokens` (quasar.decoding.prompt)."""
    metrics = Metrics()

    def finished(job: Job, completion: RequestOutput, cancelled: bool) -> None:
        first = None if job.first_piece is None else job.first_piece - job.submitted
        metrics.record(completion.stats, time.perf_counter() - job.submitted, first, cancelled)

    grammars_for(engine.vocab)  # the tokenizer bridged to the grammar engine here, not in a request's handler
    scheduler = Scheduler(engine, max_queue, max_batch, max_rows, kv_budget, on_finish=finished, own_thread=own_thread)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        scheduler.stop()

    app = FastAPI(title="quasar", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    @app.exception_handler(BadRequest)
    async def bad_request(_: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(e), e.kind, e.param, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail)), status_code=e.status_code)

    @app.exception_handler(WorkerStoppedError)
    async def unavailable(_: Request, e: WorkerStoppedError) -> JSONResponse:
        code = "shutting_down" if isinstance(e, ShuttingDownError) else "worker_stopped"
        return JSONResponse(error_body(str(e), "server_error", code=code), status_code=503)

    @app.get("/health")
    async def health() -> JSONResponse:
        body = {"status": "ok", "model": model_name, "queue_length": scheduler.waiting}
        if scheduler.unavailable is not None:
            return JSONResponse(body | {"status": "unavailable", "reason": scheduler.unavailable}, status_code=503)
        return JSONResponse(body)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        text = metrics.render(scheduler.waiting, scheduler.running, engine.caches.taken, engine.caches.kept,
                              engine.caches.budget)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "quasar",
                "max_model_len": engine.max_context}
        return {"object": "list", "data": [card]}

    fingerprint = system_fingerprint(engine.target.source_sha256, engine.path)
    prompts = PromptEncoder(engine.tokenizer, engine.max_context, allow_special_tokens)
    texts = LazyTokenTexts(prompts, engine.target.model.config.vocab_size)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req = parse(CompletionRequest, await read_json(request))
        check_model(req.model)
        return await serve(request, req, await completion_ids(req), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        req = parse(ChatRequest, await read_json(request))
        check_model(req.model)
        tools = req.tool_plan()
        if tools is not None and tools.mode == "auto" and not prompts.takes_tools:
            raise BadRequest("this model's chat template takes no tools, so tool_choice 'auto' cannot offer them to "
                             "it; 'required' or a named function holds the answer to the tools' schemas",
                             param="tool_choice")
        shown = list(tools.tools) if tools is not None and prompts.takes_tools else None
        ids = await prompts.encode([m.text() for m in req.messages], None, "messages", shown)
        return await serve(request, req, ids, chat=True, tools=tools)

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
        return await prompts.encode(str(prompt), False, "prompt")

    async def serve(http: Request, req: CompletionRequest | ChatRequest, ids: list[int], chat: bool,
                    tools: ToolPlan | None = None) -> Any:
        requested = getattr(req, "max_completion_tokens", None) or req.max_tokens
        room = budget(requested, len(ids), engine)
        if req.n > max_queue:
            raise BadRequest(f"n ({req.n}) is more choices than the server queues at once ({max_queue}, "
                             "--max-queue)", param="n")
        params = req.sampling(room, engine.target.model.config.vocab_size, tools)
        try:  # the choices of `n`: as many requests, batched together
            requests = [engine.request(ids, params.for_choice(i)) for i in range(req.n)]
        except GrammarError as e:  # the request's own field: response_format, guided_*, tool_choice
            raise BadRequest(str(e), param=req.structure(tools)[0] or e.field) from None
        except ValueError as e:
            raise BadRequest(str(e), param=getattr(e, "field", None)) from None
        jobs = submit(requests)
        envelope = Envelope(model_name, chat, None if params.logprobs is None else await texts.get(), fingerprint)
        if req.stream:
            replies = [ToolReply(tools) for _ in jobs] if tools is not None else None
            return StreamingResponse(sse(jobs, envelope, req.include_usage, replies), media_type="text/event-stream")
        watcher = asyncio.create_task(cancel_on_hang_up(http, jobs))
        try:
            completions = [await job.completion() for job in jobs]
        finally:
            watcher.cancel()
            for job in jobs:
                scheduler.cancel(job)  # no-op once finished; frees the place if this handler was cancelled
        replies = None
        if tools is not None:  # each answer read as tool calls
            replies = [ToolReply(tools) for _ in completions]
            for reply, completion in zip(replies, completions):
                reply.feed(completion.text)
                reply.finish()
        return JSONResponse(envelope.full(completions, replies))

    def submit(requests: list[EngineRequest]) -> list[Job]:
        """The requests' jobs, or none of them (HTTP 429 when the queue cannot take them all)."""
        jobs: list[Job] = []
        try:
            for request in requests:
                jobs.append(scheduler.submit(request))
        except QueueFullError as e:
            for job in jobs:
                scheduler.cancel(job)
            raise BadRequest(str(e), status=429, kind="rate_limit_exceeded", code="queue_full",
                             headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except BaseException:
            for job in jobs:
                scheduler.cancel(job)
            raise
        return jobs

    async def cancel_on_hang_up(http: Request, jobs: list[Job]) -> None:
        """A non-streaming client that goes away frees its place at the next step, as a streaming one does."""
        while not await http.is_disconnected():
            await asyncio.sleep(HANG_UP_POLL_S)
        for job in jobs:
            scheduler.cancel(job)

    async def sse(jobs: list[Job], envelope: Envelope, include_usage: bool, replies: list[ToolReply] | None = None
                  ) -> AsyncIterator[str]:
        """The stream's events; with `replies` (tools), each choice's pieces read as content and tool-call deltas."""
        no_usage = {"usage": None} if include_usage else {}  # OpenAI's chunks say so before the usage chunk

        def chunks(i: int, piece: str | None, logprobs: Any = None) -> list[dict[str, Any]]:
            """Choice i's chunks of a piece of text (None: its end, before the finish reason)."""
            if replies is None:
                return [] if piece is None else [envelope.chunk(piece, index=i, logprobs=logprobs)]
            deltas = replies[i].feed(piece) if piece is not None else replies[i].finish()
            out = [envelope.delta_chunk(delta, i) for delta in deltas if delta.text or delta.name]
            return out + ([envelope.chunk(None, index=i, logprobs=logprobs)] if logprobs else [])
        try:
            # the chat's role chunk goes out with a choice's first text, as vLLM's does: a client that times its
            # first chunk (vLLM's benchmark does) then measures the prefill, not the queue. With tools it waits for
            # the reply's first delta: a reply that opens with a tool call has no content (null, as OpenAI's)
            roles = set(range(len(jobs))) if envelope.chat else set()
            try:
                async for i, delta in merged(jobs):
                    out = chunks(i, None if delta is None else delta.text, None if delta is None else delta.logprobs)
                    if i in roles and (replies is None or out or delta is None):
                        calls = bool(out) and "tool_calls" in out[0]["choices"][0]["delta"]
                        yield event(envelope.role_chunk(i, None if calls else "") | no_usage)
                        roles.discard(i)
                    for chunk in out:
                        yield event(chunk | no_usage)
                    if delta is None:
                        reason = finish_reason(jobs[i].request.output, replies[i] if replies else None)
                        yield event(envelope.chunk(None, finish_reason=reason, index=i) | no_usage)
            except ShuttingDownError as e:  # the 200 went out: say so in the stream, and end it
                yield event(error_body(str(e), "server_error", code="shutting_down"))
                yield "data: [DONE]\n\n"
                return
            except Exception:  # generation failed after the 200 went out: say so in the stream
                log.exception("generation failed")
                yield event(error_body("generation failed (the server's log has the details)", "server_error"))
                yield "data: [DONE]\n\n"
                return
            if include_usage:
                yield event(envelope.usage_chunk([job.request.output for job in jobs]))
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                scheduler.cancel(job)  # the client went away mid-stream: stop generating, free the place

    app.add_middleware(Guard, api_key=api_key, metrics=metrics, endpoints=frozenset(r.path for r in app.routes),
                       max_body=max_body, read_timeout=read_timeout)
    return app


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def read_json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None


class PromptEncoder:
    """Prompts -> ids on the HTTP side, with a copy of the engine's tokenizer (a Rust tokenizer must not be used by
    two threads at once; this one is never used by the worker), one prompt at a time, on a helper thread. A text
    too long for the context window by its length alone is refused before any tokenization."""

    def __init__(self, tokenizer: Any, max_context: int, special: bool = False) -> None:
        self.tokenizer, self.special = copy.deepcopy(tokenizer), special
        self.lock = threading.Lock()
        longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = max_context * longest  # no text longer than this fits, whatever its tokens
        self.takes_tools = renders_tools(self.tokenizer)  # whether the chat template shows the model tools

    async def encode(self, prompt: str | list[dict[str, Any]], chat: bool | None, param: str,
                     tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt's ids; `tools`: shown to the model through its chat template."""
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        chars += len(json.dumps(tools)) if tools else 0
        if chars > self.max_chars:
            raise BadRequest(f"the prompt has {chars} characters: more than the context window can hold",
                             param=param, code="context_length_exceeded")

        def locked() -> list[int]:
            with self.lock:
                return encode(self.tokenizer, prompt, chat, self.special, tools)

        try:
            return await asyncio.to_thread(locked)
        except (ValueError, TypeError) as e:  # a template that refuses the conversation, text it cannot encode
            raise BadRequest(str(e).splitlines()[0], param=param) from None


class LazyTokenTexts:
    """The tokens' texts for logprobs (quasar.serve.logprobs.TokenTexts), read from the prompt encoder's tokenizer
    when a request first asks for logprobs."""

    def __init__(self, prompts: PromptEncoder, vocab_size: int) -> None:
        self.prompts, self.vocab_size = prompts, vocab_size
        self.texts: TokenTexts | None = None

    async def get(self) -> TokenTexts:
        def read() -> TokenTexts:
            with self.prompts.lock:
                if self.texts is None:
                    self.texts = TokenTexts(self.prompts.tokenizer, self.vocab_size)
                return self.texts

        return self.texts or await asyncio.to_thread(read)
