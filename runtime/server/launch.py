"""Deployment -> engine -> app -> uvicorn, logging what was loaded (buckets, KV pool, limits, URL).

SIGTERM (or Ctrl-C) drains before exiting: new generations get 503 while running ones finish for up to
`server.drain_timeout_s`, then the rest end with 503 and the process exits 0. A second signal exits at once.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from types import FrameType

import uvicorn
from fastapi import FastAPI

from ...artifact.manifest import Manifest
from ...artifact.settings import ConfigError
from ..deploy_config import Deployment, engine_config
from ..engine import LLMEngine
from .app import Frontend, create_app
from .engine_loop import EngineLoop

log = logging.getLogger("pagedgraph.server")


def build_app(deployment: Deployment, source: str) -> FastAPI:
    """Check the deployment against its artifact, load the engine and wrap it in the HTTP app."""
    artifact = deployment.model.artifact
    config = engine_config(deployment, Manifest.load(artifact, verify=False), source)
    engine = LLMEngine(artifact, config)
    log.info("serving %s from %s (%s)", deployment.model_name, artifact, engine.manifest.precision())
    for line in engine.describe():
        log.info(line)
    return create_app(EngineLoop(engine), deployment)


class QuietHealthChecks(logging.Filter):
    """A fleet's router checks /health every second: those 200s stay out of the access log (failures still show)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args  # uvicorn's access line: (client, method, path, http version, status)
        return not (isinstance(args, tuple) and len(args) == 5 and args[2] == "/health" and args[4] == 200)


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the frontend before the usual shutdown."""

    def __init__(self, config: uvicorn.Config, frontend: Frontend, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.frontend = frontend
        self.drain_timeout_s = drain_timeout_s
        self._drain: asyncio.Task[None] | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._event_loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs in the signal handler: only schedules the drain (a signal it does not record is not re-raised)."""
        if self.frontend.draining or self._event_loop is None:
            super().handle_exit(sig, frame)
            self.force_exit = True
            return
        self.frontend.draining = True
        log.info("signal %d: draining (new requests get 503; running ones have %s s to finish)", sig,
                 self.drain_timeout_s)
        self._event_loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        await self.frontend.drain(self.drain_timeout_s)
        self.should_exit = True


def serve(deployment: Deployment, source: str) -> None:
    """Bind first (so the logged URL has the real port, even for port 0), then run until interrupted."""
    app = build_app(deployment, source)
    settings = deployment.server
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    try:
        sock = socket.create_server((settings.host, settings.port), family=family)
    except OSError as exc:
        raise ConfigError(f"server.host/port = {settings.host}:{settings.port}: cannot listen there ({exc.strerror}); "
                          "choose another --port or --host") from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info("listening on http://%s:%d (OpenAI API under /v1%s)", shown, port,
             ", API key required" if settings.api_key else "")
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)
    logging.getLogger("uvicorn.access").addFilter(QuietHealthChecks())
    DrainingServer(config, app.state.frontend, settings.drain_timeout_s).run(sockets=[sock])
