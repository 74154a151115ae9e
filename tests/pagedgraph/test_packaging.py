"""A wheel (a non-editable install) carries what the package needs at run time, kernel sources included."""
from __future__ import annotations

import ast
import email
import json
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

import pytest

from tests.paths import REPO

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Built from a copy without earlier build output: setuptools would otherwise pack a stale build/lib."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "artifacts", "__pycache__", ".pytest_cache", "*.so"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "-w", str(tmp_path), str(source)], check=True, capture_output=True)
    (built,) = tmp_path.glob("pagedgraph-*.whl")
    return built


def test_wheel_carries_the_kernel_sources(wheel: Path) -> None:
    """The C++ kernels are compiled on first use from the installed package, so every source must ship."""
    shipped = set(zipfile.ZipFile(wheel).namelist())
    kernels = REPO / "cpu_kernels"
    sources = {f"pagedgraph/cpu_kernels/{p.name}" for p in [*kernels.glob("*.cc"), *kernels.glob("*.h")]}
    assert sources, "no kernel sources found"
    assert not sources - shipped, f"missing from the wheel: {sorted(sources - shipped)}"
    texts = {"pagedgraph/data/calibration.txt", "pagedgraph/data/heldout.txt"}  # calibration, `pagedgraph eval`
    assert not texts - shipped, f"missing from the wheel: {sorted(texts - shipped)}"


def _name(requirement: str) -> str:
    return re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_a_base_install_has_every_distribution_pagedgraph_serve_imports(wheel: Path) -> None:
    """`pip install .` is enough for `pagedgraph serve`: every third-party module the serve path imports
    comes from a base requirement of the wheel (not an extra) or from one of their own requirements."""
    with zipfile.ZipFile(wheel) as z:
        metadata = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
    base = {_name(r) for r in metadata.get_all("Requires-Dist") or [] if "extra ==" not in r}
    assert {"fastapi", "uvicorn", "prometheus-client"} <= base
    covered, todo = set(), list(base)
    while todo:
        name = todo.pop()
        if name in covered:
            continue
        covered.add(name)
        try:
            todo.extend(_name(r) for r in requires(name) or [] if "extra ==" not in r)
        except PackageNotFoundError:
            pass
    code = ("import json, sys; import pagedgraph.cli, pagedgraph.runtime.server.launch, pagedgraph.runtime.server.app, pagedgraph.exporter.export; "
            "print(json.dumps(sorted(getattr(m, '__file__', None) or '' for m in sys.modules.values())))")
    files = json.loads(subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True,
                                      text=True).stdout)
    ours = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    imported = set()  # top-level modules our loaded modules import when they load (lazy imports are optional)
    for file in files:
        path = Path(file)
        if path.suffix != ".py" or REPO not in path.parents:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                imported.update(alias.name.partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.partition(".")[0])
    owners = packages_distributions()
    missing = {f"{module} ({', '.join(owners[module])})" for module in imported - ours
               if module in owners and not any(_name(d) in covered for d in owners[module])}
    assert not missing, f"imported by the serve path but not installed by `pip install .`: {sorted(missing)}"
    assert {"uvicorn", "fastapi", "prometheus_client"} <= imported  # the check saw the server's modules


def test_no_checkout_folder_shadows_an_installed_module() -> None:
    """Run from a checkout (pytest, `python -m pagedgraph.cli`, the scripts), the repository root is on sys.path, so
    each package folder there is importable by its bare name and hides an installed module of that name:
    transformers imports the `kernels` distribution it requires, and a folder called `kernels` broke every
    reference test that loads transformers."""
    ours = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    assert {"pagedgraph", "runtime", "cpu_kernels"} <= ours
    installed = packages_distributions()
    # pagedgraph is ours when installed; auto-gptq ships a stray top-level `tests` that nothing imports
    shadowed = {f"{name} ({', '.join(installed[name])})" for name in ours - {"pagedgraph", "tests"} if name in installed}
    assert not shadowed, f"checkout folders named like installed modules: {sorted(shadowed)}; rename the folder"
