"""One source for every setting: the schemas hold each default and meaning, and the docs, EngineConfig and the CLI
are read from them, so none of them can drift."""
from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest
from pydantic import BaseModel

from pagedgraph.artifact.settings import choices, default, settings_rows
from pagedgraph.cli import _parser
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.runtime.bench.workloads import WORKLOADS
from pagedgraph.runtime.deploy_config import Deployment, EngineConfig
from pagedgraph.runtime.executors import EXECUTORS
from pagedgraph.settings_docs import TABLES, with_tables
from tests.paths import REPO

pytestmark = pytest.mark.unit
SCHEMAS: tuple[type[BaseModel], ...] = (Deployment, ExportConfig)
# A key as the docs write it: a schema's section, then dotted names (`fleet.router.*` for a whole section).
KEY = re.compile(r"`((?:model|kv_cache|buckets|scheduler|sampling|server|executor|fleet|speculative_config|export)"
                 r"(?:\.[a-z_0-9*]+)+)`")
FILE_SUFFIXES = (".md", ".py", ".yaml", ".json", ".onnx")


def _keys(schema: type[BaseModel]) -> set[str]:
    return {key for key, _, _ in settings_rows(schema)}


def test_every_table_is_the_schemas() -> None:
    for path in sorted({t.document for t in TABLES}):
        document = (REPO / path).read_text()
        assert with_tables(document, path) == document, f"{path} is stale: python -m pagedgraph.settings_docs --write"


def test_every_key_is_in_a_table() -> None:
    tabled = {key for table in TABLES for key in table.keys()}
    for schema in SCHEMAS:
        missing = _keys(schema) - tabled
        assert not missing, f"{schema.__name__} keys in no docs table (add a SettingsTable): {sorted(missing)}"


def test_every_key_the_docs_name_exists() -> None:
    keys = set().union(*(_keys(s) for s in SCHEMAS))
    sections = {".".join(key.split(".")[:i]) for key in keys for i in range(1, key.count(".") + 1)}
    wrong = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            wrong += [f"{doc.relative_to(REPO)}:{i}: {key}" for key in KEY.findall(line)
                      if not key.endswith(FILE_SUFFIXES) and key.removesuffix(".*") not in keys | sections]
    assert not wrong, "keys no schema has:\n" + "\n".join(wrong)


def test_the_engine_config_is_the_deployment_schema() -> None:
    for f in fields(EngineConfig):
        if f.name != "gears":
            assert f.default == default(Deployment, f.metadata["key"]), f.name


def test_the_cli_flags_take_choices_and_defaults_from_their_sources() -> None:
    commands = {a.dest: a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction)}["command"].choices
    flags = {(name, a.dest): a for name, p in commands.items() for a in p._actions}
    assert flags["export", "quantization"].choices == choices(ExportConfig, "model.quantization")
    assert flags["export", "dtype"].choices == choices(ExportConfig, "model.dtype")
    assert flags["bench", "workload"].choices == WORKLOADS
    for command in ("generate", "bench", "eval"):
        assert flags[command, "executor"].choices == EXECUTORS
        assert flags[command, "executor"].default == default(Deployment, "executor.name")
    assert flags["generate", "kv_cache_dtype"].choices == choices(Deployment, "kv_cache.dtype")
    assert flags["serve", "router_policy"].choices == choices(Deployment, "fleet.router.policy")


def test_the_layout_names_every_config() -> None:
    layout = next(line for line in (REPO / "docs" / "usage.md").read_text().splitlines()
                  if line.startswith("| `configs/` |"))
    missing = [p.name for p in sorted((REPO / "configs").glob("*.yaml")) if f"`{p.name}`" not in layout]
    assert not missing, f"docs/usage.md's layout row for configs/ leaves out {missing}"
