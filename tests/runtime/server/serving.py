"""The real server in a background thread, for the server test modules (one server per module)."""
from __future__ import annotations

import importlib
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator

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
