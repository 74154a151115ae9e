"""docs/design.md's request walk names exactly the files one request runs through (scripts/request_walk.py)."""
from __future__ import annotations

from pathlib import Path

from scripts.request_walk import documented, walk
from tests.paths import REPO


def test_the_design_walk_is_the_traced_one(smollm2_artifact: Path) -> None:
    files = list(walk(smollm2_artifact))
    assert files[0] == "runtime/server/app.py" and files[-1] == "runtime/executor_ort.py"
    assert documented((REPO / "docs" / "design.md").read_text()) == files, \
        "update docs/design.md section 3 from `python scripts/request_walk.py --artifact DIR`"
    assert len(files) < 15  # 15 files at 06f36f1, before the walk was shortened
