"""The OpenAI-compatible HTTP API over one shared engine loop.

A body is read under `server.max_body_bytes` (`BodyLimit`, the app's middleware) before anything parses it.
Requests are validated on the event loop and tokenized on one worker thread (a long prompt never
stalls other streams), then handed to the `EngineLoop`; a handler holds a `RequestHandle` until its
request finishes, and whichever way it ends (answered, timed out, client gone, server draining) the
handle is closed, which aborts an unfinished request and frees its blocks. Each generation is logged
once when it ends: counts and timing, never the API key, and the prompt text only with
`server.log_prompts`.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib.metadata import PackageNotFoundError, version as _distribution_version
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..deploy_config import Deployment
from ..engine import RequestOutput
from ..constraints import ConstraintError
from ..sampling_params import RequestError, SamplingParams
from . import metrics
from .engine_loop import EngineLoop, RequestHandle
from .protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     SamplingFields, TokenizeRequest)
from .tool_calls import (ToolChatFormat, ToolRequest, structured_output, template_takes_tools,
                                       tool_request)
from .responses import ChatFormat, CompletionFormat, DeltaTracker, Format, sse, usage

log = logging.getLogger("pagedgraph.server")
T = TypeVar("T")
DRAIN_FACTOR = 64  # BodyLimit drains at most this many times the limit of a refused body
RENDERED_KEPT = 256  # render answers kept for the generation a router sends next with the same body


class BodyLimit:
    """A cap on request body size (`server.max_body_bytes`), enforced before anything parses the body.

    The body is read here, up to `limit` bytes, then replayed to the app; a larger body (declared by
    Content-Length or found while reading a chunked upload) is answered 413, so no handler, JSON parser
    or tokenizer ever sees more than `limit` bytes of one request. The rest of a refused body is read and
    dropped first (up to `DRAIN_FACTOR` times the limit): closing a socket with unread data resets the
    connection, and the client would lose the 413 it had not read yet.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(receive, send, f"the request body is {int(declared)} bytes")
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-upload: let the app see it
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(receive, send, f"the request body is over {self.limit} bytes",
                                   message.get("more_body", False))
                return
            if not message.get("more_body", False):
                break
        first: Message = message if message["type"] != "http.request" else \
            {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return first

        await self.app(scope, replay, send)

    async def _refuse(self, receive: Receive, send: Send, what: str, more: bool = True) -> None:
        budget = DRAIN_FACTOR * self.limit
        while more and budget > 0:
            message = await receive()
            budget -= len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)
        error = APIError(413, f"{what}; this server accepts at most server.max_body_bytes = {self.limit} bytes "
                              "per request: send a shorter prompt", code="request_too_large")
        body = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


class _EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends, even if the body never started (early disconnect)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body is already read, so only `http.disconnect` can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class Frontend:
    """The HTTP side of the engine loop: admission, limits, response shaping, counters."""

    loop: EngineLoop
    deployment: Deployment
    counters: metrics.ServerCounters = field(default_factory=metrics.ServerCounters)

    def __post_init__(self) -> None:
        self.model = self.deployment.model_name
        engine = self.loop.engine
        self.tokenizer = engine.tokenizer
        self.prompts = engine.prompts
        self.max_model_len = engine.max_model_len
        self.max_n = engine.max_num_seqs
        sampling = self.deployment.sampling
        self.default_max_tokens = sampling.max_tokens  # for requests without max_tokens, capped by add_request
        self.defaults = {**asdict(engine.default_params),
                         **{k: v for k, v in sampling.model_dump(exclude={"max_tokens"}).items() if v is not None}}
        self.limits = self.deployment.server
        self.draining = False
        self.tokenizer.byte_table(False)  # built once here, not inside the first request that reports logprobs
        self._tokenize = ThreadPoolExecutor(1, thread_name_prefix="pagedgraph-tokenize")
        self.template_takes_tools = template_takes_tools(self.tokenizer.chat_template)
        self.metrics = metrics.Metrics(self.model, self.max_model_len)
        self.runtime = self.loop.engine.runtime_info().to_dict()
        self._rendered: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # body JSON -> prompt text, ids

    def close(self) -> None:
        self._tokenize.shutdown(wait=True)

    # -- admission: PromptEncoder (runtime/tokenizer.py) -> server limits -> EngineLoop.submit -> add_request --
    @staticmethod
    def _refused(exc: RequestError, prompt_field: str) -> APIError:
        """400 naming the field; what the engine calls `prompt` a chat request sends as `messages`."""
        return APIError(400, str(exc), param=prompt_field if exc.field == "prompt" else exc.field, code=exc.code)

    async def _on_tokenizer(self, encode: Callable[[], T], prompt_field: str) -> T:
        """A PromptEncoder call (or a grammar compile) on the tokenizer thread: a long prompt never stalls
        other streams."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenize, encode)
        except RequestError as exc:
            raise self._refused(exc, prompt_field) from None

    def _params(self, body: SamplingFields, tools: ToolRequest | None = None) -> SamplingParams:
        """The server's limit on `n`, the request's one constraint (chat: tool_calls.structured_output, which
        adds a forced tool call), then `SamplingFields.params` over the deployment's defaults."""
        if body.n > self.max_n:
            raise APIError(400, f"n = {body.n}: at most {self.max_n} completions per request (the largest batch this "
                                "deployment runs)", param="n")
        try:
            constraint = body.constraint() if tools is None else structured_output(body, tools)
        except ConstraintError as exc:
            raise APIError(400, str(exc), param=exc.field) from None
        return body.params(self.defaults, constraint)

    async def _compile(self, params: SamplingParams) -> None:
        """Compile the request's grammar on the tokenizer thread (cached for the engine), so a bad one is a 400
        and a large one never stalls the engine loop."""
        if params.structured_outputs is None:
            return
        await self._on_tokenizer(partial(self.loop.engine.compile_grammar, params.structured_outputs),
                                 params.structured_outputs.field)

    async def generate(self, request: Request, body: SamplingFields, params: SamplingParams, ids: list[int],
                       prompt_field: str, fmt: Format, prompt_text: str) -> Response:
        """Server limits, then the engine's own checks (`LLMEngine.add_request`, also `LLM`'s), then the answer."""
        await self._compile(params)
        self.check_admitting()
        if self.counters.in_flight >= self.limits.max_concurrent_requests:
            self.counters.rejected += 1
            raise APIError(429, f"the server is at max_concurrent_requests = {self.limits.max_concurrent_requests}; "
                                "retry shortly", type_="rate_limit_error", code="rate_limit_exceeded")
        self.counters.in_flight += 1
        try:
            handle = await self.loop.submit(ids, params, self.limits.request_timeout_s, self.default_max_tokens)
        except RequestError as exc:
            self.counters.in_flight -= 1
            raise self._refused(exc, prompt_field) from None
        except BaseException:
            self.counters.in_flight -= 1
            raise
        self.counters.prompt_tokens += len(ids)
        shown = prompt_text if self.limits.log_prompts else None
        close = partial(self._close, handle, request.url.path, time.perf_counter(), shown)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            hold = max((len(s) for s in params.stop), default=1) - 1
            return _EventStream(self._events(handle, fmt, params.n, hold, include_usage), close)
        try:
            out = await self._wait(request, handle)
        finally:
            close()
        if out.error:
            raise self._failure(out)
        return JSONResponse(fmt.response(out))

    def _close(self, handle: RequestHandle, path: str, started: float, prompt: str | None) -> None:
        """However the request ended: abort it if unfinished, count it, log one line (`prompt` only if asked)."""
        if not handle.finished:
            self.counters.finished["abort"] += 1
        handle.close()
        self.counters.in_flight -= 1
        counts = usage(handle.last) if handle.last is not None else {"prompt_tokens": 0, "completion_tokens": 0}
        reason = handle.last.finish_reason if handle.last is not None and handle.finished else "aborted"
        log.info("%s %s: %d prompt + %d completion tokens, %s, %.3f s%s", handle.request_id, path,
                 counts["prompt_tokens"], counts["completion_tokens"], reason, time.perf_counter() - started,
                 "" if prompt is None else f", prompt {prompt!r}")

    @staticmethod
    def _failure(out: RequestOutput) -> APIError:
        """A failed step is the server's fault (500); a request ended by a shutdown may be retried elsewhere (503)."""
        if out.finish_reason == "abort":
            return APIError(503, out.error or "aborted", type_="server_error", code="server_shutting_down")
        return APIError(500, out.error or "failed", type_="server_error")

    def _finished(self, out: RequestOutput) -> None:
        self.counters.finished[out.finish_reason or "error"] += 1
        self.counters.cached_tokens += out.num_cached_tokens
        self.metrics.observe(out)

    # -- answering ----------------------------------------------------------------------------
    def _timeout(self) -> APIError:
        return APIError(408, f"the request ran past request_timeout_s = {self.limits.request_timeout_s} and was "
                             "aborted", type_="timeout_error", code="request_timeout")

    async def _wait(self, request: Request, handle: RequestHandle) -> RequestOutput:
        result = asyncio.ensure_future(handle.result())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            result.cancel()
            gone.cancel()
        if not result.done() or result.cancelled():
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        if isinstance(result.exception(), TimeoutError):
            raise self._timeout()
        self._finished(result.result())
        return result.result()

    async def _events(self, handle: RequestHandle, fmt: Format, n: int, hold: int,
                      include_usage: bool) -> AsyncIterator[str]:
        for chunk in fmt.opening(n):
            yield sse(chunk)
        tracker = DeltaTracker(fmt, hold)
        out = None
        try:
            async for out in handle:
                if out.error:
                    self._finished(out)
                    yield sse(self._failure(out).body())
                    out = None
                    break
                chunk = tracker.chunk(out)
                if chunk is not None:
                    yield sse(chunk)
        except TimeoutError:
            yield sse(self._timeout().body())
            out = None
        if out is not None and out.finished:
            self._finished(out)
            if include_usage:
                yield sse(fmt.usage_chunk(out))
        yield sse("[DONE]")

    # -- endpoints ----------------------------------------------------------------------------
    def check_admitting(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down and takes no new requests; retry on another replica",
                           type_="server_error", code="server_shutting_down")
        self.check_engine()

    def check_engine(self) -> None:
        if not self.loop.alive:
            raise APIError(503, "the engine loop has stopped; see the server log", type_="server_error",
                           code="engine_stopped")

    async def drain(self, timeout_s: float) -> None:
        """Refuse new generations (503), let running ones finish for up to `timeout_s`, then fail the rest (503)."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self.counters.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.counters.in_flight:
            log.warning("drain_timeout_s = %s passed with %d requests running; ending them", timeout_s,
                        self.counters.in_flight)
            await self.loop.fail_all("abort", f"the server shut down before this request finished (it waited "
                                              f"server.drain_timeout_s = {timeout_s} s)")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise APIError(404, f"model {name!r} does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")

    @staticmethod
    def _completion_prompt(body: CompletionRequest) -> str | list[int]:
        """The one prompt of a completions body."""
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request; send one prompt per request "
                                    "(concurrent requests are batched together)", param="prompt")
            prompt = prompt[0]
        return prompt  # type: ignore[return-value]

    async def _completion_ids(self, prompt: str | list[int]) -> list[int]:
        return await self._on_tokenizer(partial(self.prompts.encode, prompt), "prompt") if isinstance(prompt, str) \
            else list(prompt)

    async def _chat_ids(self, body: ChatCompletionRequest, tools: ToolRequest) -> tuple[str, list[int]]:
        """The messages rendered with the chat template (and the tools), and their token ids."""
        messages, variables = tools.render([m.plain() for m in body.messages], self.template_takes_tools)
        return await self._on_tokenizer(partial(self.prompts.encode_chat, messages, **variables), "messages")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_admitting()
        prompt = self._completion_prompt(body)
        params = self._params(body)  # the body's own rules and caps before any tokenizing
        ids = (self._recall(body) or ("", await self._completion_ids(prompt)))[1]
        if body.echo and body.logprobs is not None and body.stream:
            raise APIError(400, "echo with logprobs is answered whole, not streamed: drop stream, logprobs or echo",
                           param="echo")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs are answered whole, not streamed: drop stream or prompt_logprobs",
                           param="prompt_logprobs")
        echo = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) if body.echo else ""
        fmt = CompletionFormat(self.model, self.tokenizer, body.logprobs, echo, body.prompt_logprobs is not None)
        return await self.generate(request, body, params, ids, "prompt", fmt,
                                   prompt if isinstance(prompt, str) else f"<{len(ids)} token ids>")

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_admitting()
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tools = tool_request(body, self.tokenizer)
        params = self._params(body, tools)
        text, ids = self._recall(body) or await self._chat_ids(body, tools)
        fmt = (ToolChatFormat(self.model, self.tokenizer, body.num_logprobs, tools.parser, tools.parallel)
               if tools.active else ChatFormat(self.model, self.tokenizer, body.num_logprobs))
        return await self.generate(request, body, params, ids, "messages", fmt, text)

    # vLLM's render endpoints: the prompt's token ids without generating. vllm-router's cache_aware policy asks
    # for them before it routes a request, and matches them against each replica's prefix tree.
    # The router then sends the same body to generate: the ids are kept for it, so the replica that serves it
    # does not tokenize the prompt again.
    async def render_completion(self, body: CompletionRequest) -> dict[str, Any]:
        self.check_model(body.model)
        return self._render(body, "", await self._completion_ids(self._completion_prompt(body)))

    async def render_chat(self, body: ChatCompletionRequest) -> dict[str, Any]:
        self.check_model(body.model)
        return self._render(body, *await self._chat_ids(body, tool_request(body, self.tokenizer)))

    @staticmethod
    def _key(body: SamplingFields) -> str:
        """The body as ASCII JSON: a lone surrogate in it is escaped here and refused by the tokenizer later."""
        return json.dumps(body.model_dump(), default=str)

    def _render(self, body: SamplingFields, text: str, ids: list[int]) -> dict[str, Any]:
        self._rendered[self._key(body)] = (text, ids)
        while len(self._rendered) > RENDERED_KEPT:
            self._rendered.popitem(last=False)
        return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": ids, "features": None}

    def _recall(self, body: SamplingFields) -> tuple[str, list[int]] | None:
        return self._rendered.pop(self._key(body), None) if self._rendered else None

    def models(self) -> dict[str, Any]:
        """The model card carries what runs it (`runtime`: executor, custom ops, precision), as /version does."""
        card = {"id": self.model, "object": "model", "created": 0, "owned_by": "pagedgraph",
                "max_model_len": self.max_model_len, "runtime": self.runtime}
        return {"object": "list", "data": [card]}

    def version(self) -> dict[str, Any]:
        return {"version": package_version(), **self.runtime}

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: `count`, `max_model_len`, `tokens` (and `token_strs` when asked)."""
        self.check_model(body.model)
        if body.messages is not None:
            encode = partial(self.prompts.encode_chat, [m.plain() for m in body.messages],
                             body.add_generation_prompt, bool(body.add_special_tokens))
            _, ids = await self._on_tokenizer(encode, "messages")
        else:
            assert body.prompt is not None
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await self._on_tokenizer(partial(self.prompts.encode, body.prompt, "prompt", special), "prompt")
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = [self.tokenizer.backend.id_to_token(t) for t in ids]
        return answer

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        """vLLM's /detokenize: the text of `tokens`, special tokens included."""
        self.check_model(body.model)
        vocab = self.loop.engine.model.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: token id {bad} is out of range; this model's ids are in [0, {vocab})",
                           param="tokens")
        decode = partial(self.tokenizer.decode, body.tokens)
        return {"prompt": await asyncio.get_running_loop().run_in_executor(self._tokenize, decode)}

    async def metrics_text(self) -> bytes:
        self.check_engine()
        return self.metrics.render(metrics.Scrape(await self.loop.snapshot(), self.counters,
                                                  len(asyncio.all_tasks()), threading.active_count()))


def package_version() -> str:
    try:
        return _distribution_version("pagedgraph")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _refuse(request: Request, error: APIError) -> JSONResponse:
    """Logged by status, field and code only: the message may quote the request (its prompt)."""
    log.info("%s %s refused: %d %s%s", request.method, request.url.path, error.status, error.code or error.type,
             f" (param {error.param})" if error.param else "")
    return JSONResponse(error.body(), error.status)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    """400 naming the field; the several errors of one union field (`prompt`, `stop`) become one message."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    if errors[0]["type"] == "json_invalid":
        return _refuse(request, APIError(400, "the request body is not valid JSON"))
    locs = [tuple(str(p) for p in e["loc"][1:]) for e in errors]
    common = locs[0]
    for loc in locs[1:]:
        common = common[:next((i for i, (a, b) in enumerate(zip(common, loc)) if a != b), min(len(common), len(loc)))]
    if not common:
        common, errors = locs[0], errors[:1]
    param = ".".join(common) or None
    value = errors[0].get("input")
    shown = "" if isinstance(value, dict) else f" = {_shortened(repr(value))}"
    messages = dict.fromkeys("unknown field" if e["type"] == "extra_forbidden" else e["msg"] for e in errors)
    return _refuse(request, APIError(400, f"{param or 'body'}{shown}: {'; or '.join(messages)}", param=param))


def _shortened(text: str, limit: int = 200) -> str:
    """A value quoted back in a refusal: its start, when it is long (a list of thousands of items)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's body parser: name what was wrong
        message = f"the request body is not valid JSON ({type(exc.__cause__).__name__}: {exc.__cause__})"
    return _refuse(request, APIError(exc.status_code, message, code=code))


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return _refuse(request, exc)


async def _server_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(APIError(500, f"internal error: {exc}", type_="server_error").body(), 500)


def _bearer(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        if api_key is not None and not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                           type_="authentication_error", code="invalid_api_key")
    return check


def create_app(loop: EngineLoop, deployment: Deployment) -> FastAPI:
    """The FastAPI app; its lifespan starts and stops the engine thread."""
    frontend = Frontend(loop, deployment)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            loop.stop()
            frontend.close()

    app = FastAPI(title="pagedgraph", lifespan=lifespan)
    app.state.frontend = frontend
    app.add_middleware(BodyLimit, limit=deployment.server.max_body_bytes)
    for exc_type, handler in ((RequestValidationError, _validation_error), (StarletteHTTPException, _http_error),
                              (APIError, _api_error), (Exception, _server_error)):
        app.add_exception_handler(exc_type, handler)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_bearer(deployment.server.api_key))])
    v1.add_api_route("/completions", frontend.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", frontend.chat, methods=["POST"])
    v1.add_api_route("/completions/render", frontend.render_completion, methods=["POST"])
    v1.add_api_route("/chat/completions/render", frontend.render_chat, methods=["POST"])
    v1.add_api_route("/models", frontend.models, methods=["GET"])
    app.include_router(v1)
    # vLLM serves these at the root; like /v1 they need the API key when one is set.
    root = APIRouter(dependencies=[Depends(_bearer(deployment.server.api_key))])
    root.add_api_route("/tokenize", frontend.tokenize, methods=["POST"])
    root.add_api_route("/detokenize", frontend.detokenize, methods=["POST"])
    app.include_router(root)
    app.add_api_route("/version", frontend.version, methods=["GET"])

    @app.get("/health")
    async def health() -> JSONResponse:
        status = "draining" if frontend.draining else "ok" if loop.alive else "engine stopped"
        return JSONResponse({"status": status}, 200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(await frontend.metrics_text(), media_type=metrics.CONTENT_TYPE)

    return app
