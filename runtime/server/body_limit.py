"""A cap on request body size, enforced before anything parses the body.

The body is read here, up to `limit` bytes, then replayed to the app; a larger body (declared by
Content-Length or found while reading a chunked upload) is answered 413, so no handler, JSON parser
or tokenizer ever sees more than `limit` bytes of one request. The rest of a refused body is read and
dropped first (up to `DRAIN_FACTOR` times the limit): closing a socket with unread data resets the
connection, and the client would lose the 413 it had not read yet.
"""
from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .protocol import APIError

DRAIN_FACTOR = 64


class BodyLimit:
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
