#!/usr/bin/env python
"""Which project files one `POST /v1/completions` passes through, from the HTTP request to the executor call.

    python scripts/request_walk.py --artifact DIR                        # the files, in the order they first run
    python scripts/request_walk.py --artifact DIR --check docs/design.md   # exit 1 unless its walk table is this one
    python scripts/request_walk.py --artifact DIR --write docs/design.md   # regenerate that table

A server (`build_app`, FastAPI's TestClient, every thread traced) answers the request once to warm up:
first-call imports, the tokenizer thread, the gear's input buffers. Then `sys.settrace` records, for the same
request again, every project file (outside tests/ and scripts/) in which a Python function runs, until the
engine's `Executor.run` is entered: the files the request crosses before the executor runs, then the executor's
own. Only calls count: a file read only for its constants or for dataclass-generated methods
(`graphs/contract.py`'s input names) is not on the list.
"""
from __future__ import annotations

import argparse
import ast
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedgraph.artifact.settings import replace_block  # noqa: E402

REQUEST = {"prompt": "Hello there", "max_tokens": 2}
SETTLE_S = 0.5  # after a request the engine thread checks for work once more, then waits on its queue
BEGIN = "<!-- request-walk:begin (python scripts/request_walk.py --artifact DIR --write docs/design.md) -->"
END = "<!-- request-walk:end -->"
NOT_PROJECT = ("tests", "scripts")


def project_file(path: str, root: Path = ROOT) -> str | None:
    """`path` relative to `root` when it is a project file, else None. Containment by path parts, not by string
    prefix: a virtual environment beside the checkout named like it (`DIR` and `DIRvenv`) is not the project."""
    resolved = Path(path)
    if not resolved.is_absolute() or not resolved.is_relative_to(root):
        return None
    relative = resolved.relative_to(root)
    return None if relative.parts[0] in NOT_PROJECT else str(relative)


@dataclass
class Walk:
    """The project files in the order their first function ran, and that function's name."""

    stop: Any  # the code object whose entry ends the walk (the executor's run)
    files: dict[str, str] = field(default_factory=dict)
    on: bool = False

    def trace(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.on or event != "call":
            return None
        relative = project_file(frame.f_code.co_filename)
        if relative is not None:
            self.files.setdefault(relative, frame.f_code.co_qualname)
        if frame.f_code is self.stop:
            self.on = False
        return None


def walk(artifact: Path) -> dict[str, str]:
    """file -> the first function that ran in it, for one warm request (see the module docstring); the last file is
    the executor's."""
    from fastapi.testclient import TestClient

    from pagedgraph.artifact.manifest import Manifest
    from pagedgraph.runtime.deploy_config import Deployment
    from pagedgraph.runtime.server.launch import build_app

    deployment = Deployment.model_validate({"model": {"artifact": str(artifact), "name": "walk"},
                                            "kv_cache": {"num_blocks": 64},
                                            "scheduler": {"max_model_len": min(512, Manifest.load(
                                                artifact, verify=False).max_model_len)},
                                            "executor": {"threads": 2}})
    app = build_app(deployment, "walk")
    executor = app.state.frontend.loop.engine.runner.executor
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


def purpose(path: str) -> str:
    """The first sentence of the file's module docstring: what the file is for."""
    doc = ast.get_docstring(ast.parse((ROOT / path).read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    return paragraph.split(". ")[0].rstrip(".")


def table(files: dict[str, str]) -> str:
    *crossed, executor = files.items()
    rows = [f"| {i} | `{path}` | `{function}` | {purpose(path)} |" for i, (path, function) in enumerate(crossed, 1)]
    return (f"**{len(crossed)} files** before the executor runs, then the executor's own (`{executor[0]}`, "
            f"`{executor[1]}`):\n\n| step | file | first function to run | the file |\n|---|---|---|---|\n"
            + "\n".join(rows) + "\n")


def with_table(document: str, files: dict[str, str]) -> str:
    return replace_block(document, BEGIN, END, table(files))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True, help="an exported artifact (any ladders)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--check", type=Path, help="docs/design.md: exit 1 unless its walk table is this walk's")
    what.add_argument("--write", type=Path, help="docs/design.md: replace its walk table with this walk's")
    args = parser.parse_args()
    files = walk(args.artifact)
    print(table(files), end="")
    document = args.check or args.write
    if document is None:
        return 0
    current = document.read_text()
    if args.write:
        document.write_text(with_table(current, files))
        return 0
    if with_table(current, files) != current:
        print(f"{document}: its walk table is not this walk's; run with --write {document}", file=sys.stderr)
        return 1
    print(f"{document}: the walk table matches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
