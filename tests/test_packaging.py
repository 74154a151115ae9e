"""A wheel (a non-editable install) carries what the package needs at run time, kernel sources included."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_wheel_carries_the_kernel_sources(tmp_path: Path) -> None:
    """The C++ kernels are compiled on first use from the installed package, so every source must ship.

    Built from a copy without earlier build output: setuptools would otherwise pack a stale build/lib.
    """
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "artifacts", "__pycache__", ".pytest_cache", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("pagedgraph-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    kernels = REPO / "kernels"
    sources = {f"kernels/{p.name}" for p in [*kernels.glob("*.cc"), *kernels.glob("*.h")]}
    assert sources, "no kernel sources found"
    assert not sources - shipped, f"missing from the wheel: {sorted(sources - shipped)}"
