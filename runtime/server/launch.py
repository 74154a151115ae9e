"""Deployment -> engine -> app -> uvicorn, logging what was loaded (buckets, KV pool, limits, URL)."""
from __future__ import annotations

import logging
import socket

import uvicorn
from fastapi import FastAPI

from graphs.contract import DECODE, PREFILL
from graphs.manifest import Manifest
from graphs.settings import ConfigError
from runtime.deploy_config import Deployment, engine_config
from runtime.engine import LLMEngine
from runtime.server.app import create_app
from runtime.server.engine_loop import EngineLoop

log = logging.getLogger("pagedgraph.server")


def build_app(deployment: Deployment, source: str) -> FastAPI:
    """Check the deployment against its artifact, load the engine and wrap it in the HTTP app."""
    artifact = deployment.model.artifact
    config = engine_config(deployment, Manifest.load(artifact, verify=False), source)
    engine = LLMEngine(artifact, config)
    gears = engine.packer.gears
    log.info("serving %s from %s", deployment.model_name, artifact)
    log.info("buckets: prefill T=%s (B<=%d), decode B=%s, context M=%s; %d prefill + %d decode gears",
             sorted({g.tokens for g in gears[PREFILL]}), max(g.seqs for g in gears[PREFILL]),
             sorted({g.seqs for g in gears[DECODE]}), sorted({g.blocks for g in gears[PREFILL] + gears[DECODE]}),
             len(gears[PREFILL]), len(gears[DECODE]))
    kv = engine.kv
    log.info("KV pool: %d blocks x %d tokens = %d token slots, %.1f MiB", kv.pool.num_blocks, kv.block_size,
             kv.pool.num_blocks * kv.block_size, engine.executor.pool_bytes / 2**20)
    log.info("scheduler: max_num_seqs %d, max_num_batched_tokens %d, max_model_len %d (limits clamped to the gears)",
             engine.max_num_seqs, engine.max_num_batched_tokens, engine.max_model_len)
    return create_app(EngineLoop(engine), deployment)


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
    uvicorn.Server(uvicorn.Config(app, log_level="info")).run(sockets=[sock])
