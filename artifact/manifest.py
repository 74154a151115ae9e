"""manifest.json: what an artifact holds, written by the exporter and checked by the runtime."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from graphs.config import ModelConfig
from graphs.contract import Gear
from graphs.ops import OP_SET_VERSION

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class ArtifactError(ValueError):
    """An artifact that cannot be used; the message says how to re-export."""


@dataclass(frozen=True)
class Family:
    """A bucket family: one graph file with symbolic dims and the gears it is fed with."""

    graph: str
    gears: tuple[Gear, ...]


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    block_size: int
    max_model_len: int
    dtype: str
    families: dict[str, Family]
    files: dict[str, str]  # relative path -> sha256
    export_config: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    op_set_version: int = OP_SET_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        for family in data["families"].values():
            family["gears"] = [[g["tokens"], g["seqs"], g["blocks"]] for g in family["gears"]]
        return json.dumps(data, indent=2)

    @classmethod
    def load(cls, artifact: Path, verify: bool = True) -> "Manifest":
        path = Path(artifact) / MANIFEST
        redo = f"re-export it with `pagedgraph export --config <export.yaml> --out {artifact}`"
        if not path.is_file():
            raise ArtifactError(f"{artifact} is not a pagedgraph artifact (no {MANIFEST}); {redo}")
        try:
            data = json.loads(path.read_text())
            manifest = cls(
                model=ModelConfig.from_dict(data["model"]),
                block_size=int(data["block_size"]),
                max_model_len=int(data["max_model_len"]),
                dtype=data["dtype"],
                families={name: Family(f["graph"], tuple(Gear(*g) for g in f["gears"]))
                          for name, f in data["families"].items()},
                files=dict(data["files"]),
                export_config=data.get("export_config", {}),
                format_version=int(data["format_version"]),
                op_set_version=int(data["op_set_version"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ArtifactError(f"{path} is malformed ({exc}); {redo}") from exc
        if manifest.format_version != FORMAT_VERSION or manifest.op_set_version != OP_SET_VERSION:
            raise ArtifactError(
                f"{artifact} has format {manifest.format_version}/op set {manifest.op_set_version}, this pagedgraph "
                f"reads format {FORMAT_VERSION}/op set {OP_SET_VERSION}; {redo}")
        if verify:
            for rel, digest in manifest.files.items():
                if not (Path(artifact) / rel).is_file():
                    raise ArtifactError(f"{artifact}/{rel} is missing; {redo}")
                if file_sha256(Path(artifact) / rel) != digest:
                    raise ArtifactError(f"{artifact}/{rel} is corrupted (checksum mismatch); {redo}")
        return manifest


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
