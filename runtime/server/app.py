"""The OpenAI-compatible HTTP API over one shared engine loop.

A body is read under `server.max_body_bytes` (`BodyLimit`, the app's middleware) before anything parses it.
Requests are validated on the event loop and tokenized on one worker thread (a long prompt never
stalls other streams), then handed to the `EngineLoop`, one engine request per prompt (a completions body
may hold a list of prompts: they run side by side in the engine and are answered together); a handler
holds their `RequestHandle`s until they finish, and whichever way the HTTP request ends (answered, timed
out, client gone, server draining, one of its prompts failed) every handle is closed, which aborts an
unfinished request and frees its blocks. Each generation is logged once when it ends: counts and timing,
never the API key, and the prompt text only with `server.log_prompts`.
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
from contextlib import aclosing, asynccontextmanager
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
from ..traffic import RequestLog, TraceRequest
from . import metrics
from .engine_loop import EngineLoop, PromptRefused, RequestHandle, merged
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
        plan = engine.manifest.ladder_plan
        self.metrics = metrics.Metrics(self.model, self.max_model_len,
                                       plan["expected_padding_waste"] if plan else None)
        self.request_log = RequestLog(self.limits.request_log) if self.limits.request_log else None
        self.runtime = self.loop.engine.runtime_info().to_dict()
        self._rendered: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()  # body JSON -> prompt text, ids

    def close(self) -> None:
        self._tokenize.shutdown(wait=True)
        if self.request_log is not None:
            self.request_log.close()

    # -- admission: PromptEncoder (runtime/tokenizer.py) -> server limits -> EngineLoop.submit -> add_request --
    @staticmethod
    def _refused(exc: RequestError, prompt_field: str, position: int | None = None) -> APIError:
        """400 naming the field; what the engine calls `prompt` a chat request sends as `messages`. A prompt of
        a list is named by its `position` (`prompt[2]: ...`)."""
        if position is None:
            return APIError(400, str(exc), param=prompt_field if exc.field == "prompt" else exc.field,
                            code=exc.code)
        name = f"{prompt_field}[{position}]"
        if exc.field in ("prompt", "prompt_token_ids"):
            return APIError(400, f"{name}: {str(exc).removeprefix(f'{exc.field}: ')}", param=name, code=exc.code)
        return APIError(400, f"{name}: {exc}", param=exc.field, code=exc.code)

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

    async def generate(self, request: Request, body: SamplingFields, params: SamplingParams,
                       prompts: list[list[int]], prompt_field: str, fmt: Format, shown: list[str],
                       listed: bool = False) -> Response:
        """Server limits, then the engine's own checks (`LLMEngine.add_request`, also `LLM`'s), then the answer.

        Each prompt is one generation in flight (`max_concurrent_requests`); `listed`: they came as a list, and
        a refused one is named by its position. They are queued together or not at all."""
        await self._compile(params)
        self.check_admitting()
        count = len(prompts)
        if self.counters.in_flight + count > self.limits.max_concurrent_requests:
            self.counters.rejected += 1
            raise APIError(429, f"the server is at max_concurrent_requests = {self.limits.max_concurrent_requests}; "
                                "retry shortly", type_="rate_limit_error", code="rate_limit_exceeded")
        self.counters.in_flight += count
        try:
            handles = await self.loop.submit(prompts, params, self.limits.request_timeout_s, self.default_max_tokens)
        except PromptRefused as refused:
            self.counters.in_flight -= count
            raise self._refused(refused.error, prompt_field, refused.index if listed else None) from None
        except BaseException:
            self.counters.in_flight -= count
            raise
        self.counters.prompt_tokens += sum(map(len, prompts))
        close = partial(self._close_all, handles, request.url.path, time.perf_counter(),
                        shown if self.limits.log_prompts else [None] * count)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            hold = max((len(s) for s in params.stop), default=1) - 1
            return _EventStream(self._events(handles, fmt, params.n, hold, include_usage), close)
        try:
            outs = await self._wait(request, handles)
        finally:
            close()
        failed = next((out for out in outs if out.error), None)
        if failed is not None:
            raise self._failure(failed)
        return JSONResponse(fmt.response(outs, params.n))

    def _close_all(self, handles: list[RequestHandle], path: str, started: float,
                   prompts: list[str | None]) -> None:
        for handle, prompt in zip(handles, prompts):
            self._close(handle, path, started, prompt)

    def _close(self, handle: RequestHandle, path: str, started: float, prompt: str | None) -> None:
        """However the request ended: abort it if unfinished, count it, log one line (`prompt` only if asked)."""
        if not handle.finished:
            self.counters.finished["abort"] += 1
        handle.close()
        self.counters.in_flight -= 1
        counts = usage([handle.last]) if handle.last is not None else {"prompt_tokens": 0, "completion_tokens": 0}
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
        if self.request_log is not None:
            try:
                for completion in out.outputs:
                    if completion.token_ids:
                        self.request_log.write(TraceRequest(len(out.prompt_token_ids), len(completion.token_ids)))
            except OSError:  # a full disk loses log lines, never answers
                log.exception("server.request_log %s: write failed", self.request_log.path)

    # -- answering ----------------------------------------------------------------------------
    def _timeout(self) -> APIError:
        return APIError(408, f"the request ran past request_timeout_s = {self.limits.request_timeout_s} and was "
                             "aborted", type_="timeout_error", code="request_timeout")

    async def _wait(self, request: Request, handles: list[RequestHandle]) -> list[RequestOutput]:
        """Every prompt's final output, in order; or the first that failed (the caller answers its error)."""
        each = [asyncio.ensure_future(handle.result()) for handle in handles]
        gone = asyncio.ensure_future(_disconnected(request))
        left = set(each)
        try:
            while left and not gone.done():
                done, _ = await asyncio.wait((*left, gone), return_when=asyncio.FIRST_COMPLETED)
                left -= done
                if any(f.exception() is not None or f.result().error for f in done if f in each):
                    break
        finally:
            for future in (*each, gone):
                future.cancel()
        ended = [f for f in each if f.done() and not f.cancelled()]
        failed = next((f for f in ended if f.exception() is not None or f.result().error), None)
        if failed is None and len(ended) < len(each):
            raise APIError(499, "the client closed the connection", code="client_closed_request")
        if failed is not None and isinstance(failed.exception(), TimeoutError):
            raise self._timeout()
        outs = [f.result() for f in each] if failed is None else [failed.result()]
        for out in outs:
            self._finished(out)
        return outs

    async def _events(self, handles: list[RequestHandle], fmt: Format, n: int, hold: int,
                      include_usage: bool) -> AsyncIterator[str]:
        """Every prompt's chunks as they come; a failed or timed-out prompt ends the stream with its error."""
        for chunk in fmt.opening(n):
            yield sse(chunk)
        tracker = DeltaTracker(fmt, hold, n)
        last: list[RequestOutput | None] = [None] * len(handles)
        try:
            async with aclosing(merged(handles)) as outputs:
                async for prompt, out in outputs:
                    if out.error:
                        self._finished(out)
                        yield sse(self._failure(out).body())
                        break
                    last[prompt] = out
                    if out.finished:
                        self._finished(out)
                    chunk = tracker.chunk(prompt, out)
                    if chunk is not None:
                        yield sse(chunk)
                else:
                    if include_usage:
                        yield sse(fmt.usage_chunk([out for out in last if out is not None]))
        except TimeoutError:
            yield sse(self._timeout().body())
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

    def _completion_prompts(self, body: CompletionRequest) -> list[str | list[int]]:
        """The prompts of a completions body, within `server.max_prompts_per_request` (and what can be in flight)."""
        prompts = body.prompts
        limit, setting = min((self.limits.max_prompts_per_request, "max_prompts_per_request"),
                             (self.limits.max_concurrent_requests, "max_concurrent_requests"))
        if len(prompts) > limit:
            raise APIError(400, f"{len(prompts)} prompts in one request; this server takes at most server.{setting} = "
                                f"{limit} per request: split the list", param="prompt")
        return prompts

    async def _completion_ids(self, body: CompletionRequest, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids; the text ones tokenized together on the tokenizer thread."""
        if all(not isinstance(prompt, str) for prompt in prompts):
            return [list(prompt) for prompt in prompts]
        return await self._on_tokenizer(partial(self._encode_all, prompts, body.listed), "prompt")

    def _encode_all(self, prompts: list[str | list[int]], listed: bool) -> list[list[int]]:
        return [self.prompts.encode(prompt, f"prompt[{i}]" if listed else "prompt") if isinstance(prompt, str)
                else list(prompt) for i, prompt in enumerate(prompts)]

    async def _chat_ids(self, body: ChatCompletionRequest, tools: ToolRequest) -> tuple[str, list[int]]:
        """The messages rendered with the chat template (and the tools), and their token ids."""
        messages, variables = tools.render([m.plain() for m in body.messages], self.template_takes_tools)
        return await self._on_tokenizer(partial(self.prompts.encode_chat, messages, **variables), "messages")

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        self.check_admitting()
        prompts = self._completion_prompts(body)
        params = self._params(body)  # the body's own rules and caps before any tokenizing
        recalled = self._recall(body)
        ids = [recalled[1]] if recalled is not None else await self._completion_ids(body, prompts)
        if body.echo and body.logprobs is not None and body.stream:
            raise APIError(400, "echo with logprobs is answered whole, not streamed: drop stream, logprobs or echo",
                           param="echo")
        if body.prompt_logprobs is not None and body.stream:
            raise APIError(400, "prompt_logprobs are answered whole, not streamed: drop stream or prompt_logprobs",
                           param="prompt_logprobs")
        echo = [p if isinstance(p, str) else self.tokenizer.decode(i) for p, i in zip(prompts, ids)] \
            if body.echo else None
        fmt = CompletionFormat(self.model, self.tokenizer, body.logprobs, echo, body.prompt_logprobs is not None)
        shown = [p if isinstance(p, str) else f"<{len(i)} token ids>" for p, i in zip(prompts, ids)]
        return await self.generate(request, body, params, ids, "prompt", fmt, shown, body.listed)

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
        return await self.generate(request, body, params, [ids], "messages", fmt, [text])

    # vLLM's render endpoints: the prompt's token ids without generating. vllm-router's cache_aware policy asks
    # for them before it routes a request, and matches them against each replica's prefix tree.
    # The router then sends the same body to generate: the ids are kept for it, so the replica that serves it
    # does not tokenize the prompt again.
    async def render_completion(self, body: CompletionRequest) -> dict[str, Any]:
        """A list of prompts is routed by its first prompt's ids, and is tokenized again when it is sent."""
        self.check_model(body.model)
        ids = await self._completion_ids(body, self._completion_prompts(body))
        return self._render(body, "", ids[0], keep=not body.listed)

    async def render_chat(self, body: ChatCompletionRequest) -> dict[str, Any]:
        self.check_model(body.model)
        return self._render(body, *await self._chat_ids(body, tool_request(body, self.tokenizer)))

    @staticmethod
    def _key(body: SamplingFields) -> str:
        """The body as ASCII JSON: a lone surrogate in it is escaped here and refused by the tokenizer later."""
        return json.dumps(body.model_dump(), default=str)

    def _render(self, body: SamplingFields, text: str, ids: list[int], keep: bool = True) -> dict[str, Any]:
        if keep:
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

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: special tokens, chat template, length limit. lm-evaluation-harness finds it and
        then tokenizes through /tokenize and /detokenize (its `remote` tokenizer), with no tokenizer of its own."""
        tokenizer = self.tokenizer
        eos, bos = tokenizer.eos_token_ids, tokenizer.bos_token_id
        return {"tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": tokenizer.backend.id_to_token(eos[0]) if eos else None,
                "bos_token": tokenizer.backend.id_to_token(bos) if bos is not None else None,
                "pad_token": None, "add_bos_token": tokenizer.add_bos_token, "model_max_length": self.max_model_len,
                "chat_template": tokenizer.chat_template}

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
    root.add_api_route("/tokenizer_info", frontend.tokenizer_info, methods=["GET"])
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
