"""The runtime's seams hold: the server and the speculator never reach through the engine into its parts, the engine
stays small, and so does every function of the runtime (checked on the source with `ast`)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit
RUNTIME = REPO / "runtime"
# What may be read through the engine: its artifact's description and its settings.
OPEN_PARTS = {"manifest", "model", "config"}
MAX_ENGINE_LINES, MAX_FUNCTION_LINES = 300, 60


def _chain(node: ast.Attribute) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"]; a call or subscript in the middle starts the chain after it."""
    names = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if isinstance(current, ast.Name):
        names.append(current.id)
    return names[::-1]


def _reaches_through(path: Path, root: Path = REPO) -> list[str]:
    """`engine.<part>.<member>` chains (the engine as a name or an attribute) outside OPEN_PARTS."""
    found = []
    tree = ast.parse(path.read_text())
    outermost = {id(child) for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                 for child in [node.value] if isinstance(child, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in outermost:
            continue
        names = _chain(node)
        for i, name in enumerate(names[:-2]):
            if name == "engine" and names[i + 1] not in OPEN_PARTS:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {'.'.join(names)}")
                break
    return found


def test_the_server_and_the_speculator_never_reach_through_the_engine() -> None:
    found = [hit for package in ("server", "spec") for path in sorted((RUNTIME / package).glob("*.py"))
             for hit in _reaches_through(path)]
    assert not found, "ask the engine (snapshot(), describe(), a method) instead:\n" + "\n".join(found)


def test_the_check_finds_a_chain_through_the_engine(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text("a = self.loop.engine.runner.pools\nb = engine.model.vocab_size\nc = engine.snapshot()\n")
    assert _reaches_through(source, tmp_path) == ["probe.py:1: self.loop.engine.runner.pools"]


def test_the_engine_class_and_every_runtime_function_stay_short() -> None:
    long = []
    for path in sorted(RUNTIME.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and node.name == "LLMEngine":
                assert lines <= MAX_ENGINE_LINES, f"LLMEngine is {lines} lines: move a part out of it"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, "split these:\n" + "\n".join(long)
