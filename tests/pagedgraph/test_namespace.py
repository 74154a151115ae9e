"""Everything is imported under the pagedgraph namespace: no module imports, patches or runs (-m) the bare
top-level names runtime, graphs, exporter, kernels, artifact, which are generic enough to clash with other installed packages."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = next(p for p in Path(__file__).resolve().parents if (p / "setup.cfg").is_file())
BARE = {'graphs', 'exporter', 'runtime', 'artifact', 'kernels'}
DOTTED = re.compile(r"^(runtime|graphs|exporter|kernels|artifact)\.\w+(\.\w+)*$")


def _python_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [REPO / p for p in out.split()]


def test_no_module_imports_a_bare_top_level_name() -> None:
    bad = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            bad += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in BARE]
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and DOTTED.match(node.value) \
                    and node.value.rsplit(".", 1)[-1] not in {"h", "cc", "py", "json", "onnx", "txt", "md"}:
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: string {node.value!r}")
    assert not bad, "bare top-level names (use pagedgraph.<name>):\n" + "\n".join(bad)


def test_the_packages_import_their_own_modules_relatively() -> None:
    """Inside the packages, absolute pagedgraph.x imports would read as imports of the one pagedgraph package
    to the reviewers' import-graph tool; modules import each other relatively."""
    roots = BARE | {"pagedgraph"}
    bad = []
    for path in _python_files():
        if path.relative_to(REPO).parts[0] not in roots:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            bad += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] == "pagedgraph"]
    assert not bad, "absolute imports inside the packages (make them relative):\n" + "\n".join(bad)


def test_the_public_api_imports_lazily_and_without_a_circle() -> None:
    code = ("import sys, pagedgraph; assert 'pagedgraph.runtime.engine' not in sys.modules; "
            "from pagedgraph import LLM, SamplingParams; "
            "assert LLM.__module__ == 'pagedgraph.runtime.engine', LLM.__module__; "
            "assert not ({'runtime', 'graphs', 'exporter'} & set(sys.modules)), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
