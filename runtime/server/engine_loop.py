"""One thread owns the engine; HTTP handlers reach it only through a command queue.

The engine is not thread-safe, so every engine call (add, abort, step, metrics) runs on the loop
thread: handlers enqueue commands, the thread runs them between steps and hands each step's outputs
back to the event loop in one `call_soon_threadsafe`. All HTTP requests share that one loop, which is
what makes batching continuous across them. The thread blocks on the queue while the engine is idle.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, AsyncIterator, Callable, TypeVar

from ..engine import EngineSnapshot, LLMEngine, RequestOutput
from ..sampling_params import DEFAULT_MAX_TOKENS, RequestError, SamplingParams

log = logging.getLogger("pagedgraph.server")
T = TypeVar("T")
_STOP = object()
_EXPIRED = object()


class PromptRefused(Exception):
    """`LLMEngine.add_request` refused prompt number `index` of a submission (`error` says why); nothing of the
    submission stays queued."""

    def __init__(self, index: int, error: RequestError) -> None:
        super().__init__(f"prompt {index}: {error}")
        self.index = index
        self.error = error


class RequestHandle:
    """One request's outputs, as the engine produces them; `close()` aborts it unless it finished.

    Iterating raises TimeoutError once `timeout_s` has passed without a final output.
    """

    def __init__(self, loop: "EngineLoop", request_id: str, timeout_s: float) -> None:
        self.request_id = request_id
        self.outputs: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None
        self._loop = loop
        self._timer = asyncio.get_running_loop().call_later(timeout_s, self.outputs.put_nowait, _EXPIRED)

    def __aiter__(self) -> "RequestHandle":
        return self

    async def __anext__(self) -> RequestOutput:
        """The newest output: outputs are cumulative, so skipped ones lose nothing."""
        if self.finished:
            raise StopAsyncIteration
        out = await self.outputs.get()
        while out is not _EXPIRED and not out.finished and not self.outputs.empty():
            out = self.outputs.get_nowait()
        if out is _EXPIRED:
            raise TimeoutError(self.request_id)
        self.finished = out.finished
        self.last = out
        return out

    async def result(self) -> RequestOutput:
        async for out in self:
            if out.finished:
                return out
        raise RuntimeError(f"{self.request_id} ended without a final output")

    def close(self) -> None:
        self._timer.cancel()
        self._loop.release(self)


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several handles as they come, each with its handle's position; ends when all have finished.

    Raises the first TimeoutError of any of them. Close it (`contextlib.aclosing`) to stop waiting on the rest.
    """
    waiting = {asyncio.ensure_future(handle.__anext__()): i for i, handle in enumerate(handles)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=waiting.__getitem__):
                i = waiting.pop(future)
                try:
                    out = future.result()
                except StopAsyncIteration:
                    continue
                yield i, out
                waiting[asyncio.ensure_future(handles[i].__anext__())] = i
    finally:
        for future in waiting:
            future.cancel()


class EngineLoop:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._handles: dict[str, RequestHandle] = {}  # event-loop side only
        self._live: set[str] = set()  # engine-thread side only: requests added and not yet finished
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, event_loop: asyncio.AbstractEventLoop) -> None:
        self._event_loop = event_loop
        self._thread = threading.Thread(target=self._run, name="pagedgraph-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- event-loop side --------------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(error: BaseException | None, result: Any) -> None:
            if future.done():
                return
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

        def command() -> None:
            try:
                result = fn()
            except Exception as exc:
                loop.call_soon_threadsafe(settle, exc, None)
            else:
                loop.call_soon_threadsafe(settle, None, result)

        self._commands.put(command)
        return await future

    async def submit(self, prompts: list[list[int]], params: SamplingParams, timeout_s: float,
                     default_max_tokens: int = DEFAULT_MAX_TOKENS) -> list[RequestHandle]:
        """Queue one request per prompt through `LLMEngine.add_request`, all in one command (no step runs
        between them); raises PromptRefused if one cannot be served, and then none stays queued."""
        handles = [RequestHandle(self, self.engine.new_request_id(), timeout_s) for _ in prompts]
        for handle in handles:
            self._handles[handle.request_id] = handle
        request_ids = [handle.request_id for handle in handles]
        try:
            await self.call(lambda: self._add(request_ids, prompts, params, default_max_tokens))
        except BaseException:  # cancelled or refused: the aborts queued behind the add undo it
            for handle in handles:
                handle.close()
            raise
        return handles

    async def snapshot(self) -> EngineSnapshot:
        return await self.call(self.engine.snapshot)

    async def fail_all(self, reason: str, error: str) -> None:
        """End every request in the engine with `error` (finish reason `reason`); they free their blocks."""
        await self.call(lambda: self._fail(reason, error))

    def release(self, handle: RequestHandle) -> None:
        if self._handles.pop(handle.request_id, None) is not None and not handle.finished:
            self._commands.put(lambda: self._abort(handle.request_id))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            handle = self._handles.get(out.request_id)
            if handle is not None:
                handle.outputs.put_nowait(out)

    # -- engine-thread side -----------------------------------------------------------------
    def _add(self, request_ids: list[str], prompts: list[list[int]], params: SamplingParams,
             default_max_tokens: int) -> None:
        """All or nothing: a refused prompt aborts the ones added before it."""
        added: list[str] = []
        try:
            for index, (request_id, prompt_token_ids) in enumerate(zip(request_ids, prompts)):
                try:
                    self.engine.add_request(prompt_token_ids, params, request_id,
                                            default_max_tokens=default_max_tokens)
                except RequestError as exc:
                    raise PromptRefused(index, exc) from None
                self._live.add(request_id)
                added.append(request_id)
        except BaseException:
            for request_id in added:
                self._abort(request_id)
            raise

    def _abort(self, request_id: str) -> None:
        if request_id in self._live:
            self._live.discard(request_id)
            self.engine.abort(request_id)

    def _run(self) -> None:
        engine, commands = self.engine, self._commands
        while True:
            command = commands.get() if not engine.has_unfinished() else self._next_command()
            while command is not None:
                if command is _STOP:
                    return
                try:
                    command()
                except Exception:  # an abort that failed must not stop the loop serving everyone else
                    log.exception("engine command failed")
                command = self._next_command()
            if engine.has_unfinished():
                self._step()

    def _next_command(self) -> Any:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine bug: fail what is in flight, keep serving new requests
            log.exception("engine step failed; failing %d in-flight requests", len(self._live))
            self._fail("error", f"engine step failed: {exc}")
            return
        self._publish(outputs)

    def _fail(self, reason: str, error: str) -> None:
        outputs = [RequestOutput(rid, [], [], "", reason, error=error) for rid in self._live]
        for out in outputs:
            try:
                self.engine.abort(out.request_id)
            except Exception:
                log.exception("abort of %s failed", out.request_id)
        self._publish(outputs)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._live.discard(out.request_id)
        if outputs:
            assert self._event_loop is not None
            self._event_loop.call_soon_threadsafe(self._deliver, outputs)
