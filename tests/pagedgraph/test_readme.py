"""The README's runnable examples, run as written against the real model so the README cannot rot.

Every fenced bash or python block preceded by `<!-- runnable -->` runs, in README order, in one fresh
directory that holds a copy of configs/ (the paths the examples use are relative to the repository root).
`pagedgraph` is this checkout's CLI. The one change: the server's port 8000 becomes a free port, so a
server someone else runs on this machine cannot answer in its place.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.slow
ROOT = REPO
BLOCK = re.compile(r"<!-- runnable -->\n```(bash|python)\n(.*?)```", re.S)


def runnable_blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in BLOCK.finditer(text)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_the_readme_marks_its_examples_runnable() -> None:
    blocks = runnable_blocks((ROOT / "README.md").read_text())
    kinds = [kind for kind, _ in blocks]
    assert kinds.count("bash") >= 2 and kinds.count("python") >= 2, kinds
    usage = blocks[0][1]
    assert "pagedgraph export" in usage and "prompts.jsonl <<" in usage, "prompts.jsonl is written before it is used"


def test_the_readme_examples_run(tmp_path: Path) -> None:
    pytest.importorskip("openai")
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PAGEDGRAPH_CACHE": str(tmp_path / "cache")}
    prelude = f'pagedgraph() {{ "{sys.executable}" -m pagedgraph.cli "$@"; }}\nset -euo pipefail\n'
    outputs = []
    groups = []  # process groups of the blocks, so a server a block left running is stopped at the end
    try:
        for i, (kind, code) in enumerate(runnable_blocks((ROOT / "README.md").read_text())):
            code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}").replace(
                "deploy-smollm2.yaml &", f"deploy-smollm2.yaml --port {port} &")
            argv = ["bash", "-c", prelude + code] if kind == "bash" else [sys.executable, "-c", code]
            out, err = tmp_path / f"block{i}.out", tmp_path / f"block{i}.err"
            with open(out, "w") as stdout, open(err, "w") as stderr:  # files: a background server keeps them open
                proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=stdout, stderr=stderr,
                                        start_new_session=True)
                groups.append(proc.pid)
                proc.wait(timeout=600)
            assert proc.returncode == 0, (f"README block failed ({kind}):\n{code}\nstdout:\n{out.read_text()}\n"
                                          f"stderr:\n{err.read_text()}")
            outputs.append(out.read_text())
    finally:
        for group in groups:
            try:
                os.killpg(group, signal.SIGTERM)
            except ProcessLookupError:
                pass
    usage, python_api, serving, streaming = outputs
    assert "The capital of France is Paris" in usage and "buckets       prefill" in usage
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
    assert "Paris" in python_api
    assert '"status":"ok"' in serving.replace(" ", "") and "Paris" in serving
    words = re.findall(r"[a-z]+", streaming.lower())
    colours = {"red", "blue", "green", "yellow", "orange", "purple", "pink", "black", "white", "brown"}
    assert len(words) >= 3 and colours & set(words), streaming
