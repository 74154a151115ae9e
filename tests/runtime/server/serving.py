"""The real server in a background thread, for the server test modules (one server per module)."""
from __future__ import annotations

import importlib
import re
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import httpx
import uvicorn

from pagedgraph.runtime.deploy_config import Deployment
from pagedgraph.runtime.server.launch import build_app
from tests.conftest import missing_toolchain

MODEL = "smol"


class ServerThread:
    """uvicorn in a background thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.app = app
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@contextmanager
def serve(artifact: Path, **sections: dict[str, Any]) -> Iterator[ServerThread]:
    """Serve `artifact` as MODEL on 2 threads; `sections` are the deployment YAML's other sections."""
    deployment = Deployment.model_validate({"model": {"artifact": str(artifact), "name": MODEL},
                                            "executor": {"threads": 2}, **sections})
    thread = ServerThread(build_app(deployment, "test"))
    try:
        yield thread
    finally:
        thread.stop()


def metrics(server: ServerThread) -> dict[str, float]:
    """The server's pagedgraph_* gauges and counters by name, and the whole text under "raw"."""
    text = httpx.get(f"{server.url}/metrics").text
    return {m[1]: float(m[2]) for m in re.finditer(r"^(pagedgraph_\S+) (\S+)$", text, re.M)} | \
        {"raw": text}  # type: ignore[dict-item]


def wait_for(server: ServerThread, condition: Callable[[dict[str, float]], bool],
             timeout: float = 10.0) -> dict[str, float]:
    """The metrics once `condition` holds for them (polled); fails after `timeout` seconds, showing them."""
    deadline = time.monotonic() + timeout
    while True:
        now = metrics(server)
        if condition(now):
            return now
        assert time.monotonic() < deadline, f"metrics never reached the condition:\n{now['raw']}"
        time.sleep(0.05)


def idle(server: ServerThread) -> dict[str, float]:
    """The metrics once nothing is running, waiting, in flight or holding a KV block."""
    return wait_for(server, lambda m: m["pagedgraph_kv_blocks_used"] == m["pagedgraph_requests_running"]
                    == m["pagedgraph_requests_waiting"] == m["pagedgraph_http_requests_in_flight"] == 0)


def assert_refused_before_running(server: ServerThread, send: Callable[[], httpx.Response], param: str,
                                  words: str) -> None:
    """`send()` gets a 400 naming `param`, its message starting with `words`, and nothing of the request ran: no
    step, every KV block free (a bad part of a request refuses the whole of it before any part is queued)."""
    before = idle(server)
    response = send()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(words), error
    after = idle(server)
    assert after["pagedgraph_steps_total"] == before["pagedgraph_steps_total"], "part of the request ran"
    assert after["pagedgraph_kv_blocks_free"] == after["pagedgraph_kv_blocks_total"]


def fail_the_next_step(server: ServerThread) -> None:
    """The engine's next step raises RuntimeError("injected"), once: the step after it runs as ever."""
    packer = server.app.state.frontend.loop.engine.runner.packer

    def broken(batch: Any) -> Any:
        del packer.select  # the class's method again
        raise RuntimeError("injected")

    packer.select = broken


def client_library(name: str) -> ModuleType:
    """A client of the `clients` extra (lm-evaluation-harness, LangChain): skipped where it is not installed, a
    failure in CI, where scripts/test.sh installs it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        missing_toolchain(f"the `clients` extra ({name}: pip install -e '.[clients]')", error)
