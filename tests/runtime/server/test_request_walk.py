"""docs/design.md's request walk is the traced one (scripts/request_walk.py), and it stays short."""
from __future__ import annotations

from pathlib import Path

import pytest

from scripts.request_walk import project_file, walk, with_table
from tests.paths import REPO

pytestmark = pytest.mark.unit
MAX_FILES = 10  # crossed before the executor runs; 12 at 9dbf44e, before the model runner and output processor


def test_the_design_walk_is_the_traced_one(tiny_artifact: Path) -> None:
    files = walk(tiny_artifact)
    crossed, executor = list(files)[:-1], list(files)[-1]
    assert crossed[0] == "runtime/server/app.py" and executor == "runtime/executor_ort.py"
    assert len(crossed) <= MAX_FILES, crossed
    design = (REPO / "docs" / "design.md").read_text()
    assert with_table(design, files) == design, \
        "docs/design.md's walk is stale: python scripts/request_walk.py --artifact DIR --write docs/design.md"


def test_a_venv_named_like_the_checkout_beside_it_is_not_the_project(tmp_path: Path) -> None:
    """A fresh clone at DIR with its venv at DIRvenv: the venv's files share the checkout's string prefix."""
    root = tmp_path / "pagedgraph"
    assert project_file(str(root / "runtime" / "engine.py"), root) == "runtime/engine.py"
    assert project_file(str(tmp_path / "pagedgraphvenv" / "lib" / "anyio" / "_core.py"), root) is None
    assert project_file(str(root / "tests" / "conftest.py"), root) is None
    assert project_file("<string>", root) is None
