#!/usr/bin/env python
"""Which project files one `POST /v1/completions` passes through, from the HTTP request to the executor call.

    python scripts/request_walk.py --artifact DIR                      # the files, in the order they first run
    python scripts/request_walk.py --artifact DIR --check docs/design.md   # exit 1 unless section 3 names them

A server (`build_app`, FastAPI's TestClient, every thread traced) answers the request once to warm up:
first-call imports, the tokenizer thread, the gear's input buffers. Then `sys.settrace` records, for the same
request again, every project file (outside tests/ and scripts/) in which a Python function runs, until the
engine's `Executor.run` is entered. Only calls count: a file read only for its constants or for
dataclass-generated methods (`graphs/contract.py`'s input names) is not on the list.
"""
from __future__ import annotations

import argparse
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
REQUEST = {"prompt": "Hello there", "max_tokens": 2}
SECTION = "## 3. One request"
SETTLE_S = 0.5  # after a request the engine thread checks for work once more, then waits on its queue


@dataclass
class Walk:
    """The project files in the order their first function ran, and that function's name."""

    stop: Any  # the code object whose entry ends the walk (the executor's run)
    files: dict[str, str] = field(default_factory=dict)
    on: bool = False

    def trace(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return None
        path = frame.f_code.co_filename
        if path.startswith(str(ROOT)) and not path.startswith((str(ROOT / "tests"), str(ROOT / "scripts"))):
            self.files.setdefault(str(Path(path).relative_to(ROOT)), frame.f_code.co_qualname)
        if frame.f_code is self.stop:
            self.on = False
        return None


def walk(artifact: Path) -> dict[str, str]:
    """file -> the first function that ran in it, for one warm request (see the module docstring)."""
    sys.path.insert(0, str(ROOT))
    from fastapi.testclient import TestClient

    from pagedgraph.runtime.deploy_config import Deployment
    from pagedgraph.runtime.server.launch import build_app

    deployment = Deployment.model_validate({"model": {"artifact": str(artifact), "name": "walk"},
                                            "kv_cache": {"num_blocks": 64}, "scheduler": {"max_model_len": 512},
                                            "executor": {"threads": 2}})
    app = build_app(deployment, "walk")
    executor = app.state.frontend.loop.engine.executor
    tracer = Walk(type(executor).run.__code__)
    sys.settrace(tracer.trace)
    threading.settrace(tracer.trace)
    try:
        with TestClient(app) as client:
            for on in (False, True):
                time.sleep(SETTLE_S)
                tracer.on = on
                response = client.post("/v1/completions", json=REQUEST)
                assert response.status_code == 200, response.text
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    return tracer.files


def documented(design: str) -> list[str]:
    """The files named in the walk table of docs/design.md's section 3, in table order."""
    start = design.index(SECTION)
    end = design.find("\n## ", start + len(SECTION))
    return re.findall(r"^\| \d+ \| `([^`]+)` \|", design[start:end if end >= 0 else None], re.M)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True, help="an exported artifact (any ladders)")
    parser.add_argument("--check", type=Path, help="docs/design.md: exit 1 unless its walk table names these files")
    args = parser.parse_args()
    files = walk(args.artifact)
    print(f"{len(files)} files from POST /v1/completions to {list(files)[-1]}:")
    for i, (path, function) in enumerate(files.items(), 1):
        print(f"{i:3d}  {path:40s} {function}")
    if args.check is None:
        return 0
    named = documented(args.check.read_text())
    if named != list(files):
        print(f"{args.check}: the walk table names {len(named)} files {named}, the request ran {list(files)}; "
              f"update the table from this list", file=sys.stderr)
        return 1
    print(f"{args.check}: the walk table matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
