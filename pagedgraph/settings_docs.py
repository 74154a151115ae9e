"""The docs' settings tables, generated from the schemas that hold each setting's default and meaning.

`python -m pagedgraph.settings_docs` prints them; `--write` replaces each between its markers in its document
(tests/pagedgraph/test_settings_docs.py fails when one is stale, when a key is in no table, or when a doc names a
key no schema has).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from .artifact.settings import replace_block, settings_rows, settings_table
from .exporter.config import ExportConfig, LadderPlanRecord
from .runtime.deploy_config import Deployment, FleetSection
from .runtime.spec.config import SpeculativeConfig

COMMAND = "python -m pagedgraph.settings_docs --write"


@dataclass(frozen=True)
class SettingsTable:
    name: str
    document: str  # relative to the repository's root, where `--write` runs
    schema: type[BaseModel]
    prefix: str = ""  # the schema's place in its YAML
    elsewhere: frozenset[str] = field(default_factory=frozenset)  # sections another table lists

    @property
    def markers(self) -> tuple[str, str]:
        return f"<!-- settings:{self.name}:begin ({COMMAND}) -->", f"<!-- settings:{self.name}:end -->"

    def keys(self) -> list[str]:
        return [key for key, _, _ in settings_rows(self.schema, self.prefix, self.elsewhere)]

    def text(self) -> str:
        return settings_table(self.schema, self.prefix, self.elsewhere)


TABLES = (
    SettingsTable("deployment", "docs/server.md", Deployment, elsewhere=frozenset({"fleet", "speculative_config"})),
    SettingsTable("fleet", "docs/scale-out.md", FleetSection, "fleet."),
    SettingsTable("export", "docs/usage.md", ExportConfig, elsewhere=frozenset({"export.buckets.plan"})),
    SettingsTable("plan", "docs/usage.md", LadderPlanRecord, "export.buckets.plan."),
    SettingsTable("speculative", "docs/usage.md", SpeculativeConfig, "speculative_config."),
)


def with_tables(document: str, path: str) -> str:
    """`document` (at `path`) with each of its tables regenerated."""
    for table in TABLES:
        if table.document == path:
            document = replace_block(document, *table.markers, table.text())
    return document


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace the tables in their documents")
    args = parser.parse_args()
    for path in sorted({t.document for t in TABLES}):
        if args.write:
            Path(path).write_text(with_tables(Path(path).read_text(), path))
        else:
            print("\n\n".join(f"{t.name} ({path}):\n{t.text()}" for t in TABLES if t.document == path))


if __name__ == "__main__":
    main()
