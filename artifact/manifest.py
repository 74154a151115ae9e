"""manifest.json: what an artifact holds, written by the exporter and checked by the runtime."""
from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..graphs.config import ModelConfig
from ..graphs.contract import Gear
from ..graphs.ops import OP_SET_VERSION

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
class RankLayout:
    """One tensor-parallel rank: its graphs' folder (graphs/rank<r>/: each graph file and its weights) and the
    half-open ranges of query heads, KV heads and intermediate channels it holds (graphs/tensor_parallel.py)."""

    rank: int
    folder: str
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RankLayout":
        return cls(int(data["rank"]), data["folder"], *(tuple(int(v) for v in data[k])
                                                        for k in ("heads", "kv_heads", "intermediate")))


@dataclass(frozen=True)
class Manifest:
    model: ModelConfig
    block_size: int
    max_model_len: int
    dtype: str
    families: dict[str, Family]
    files: dict[str, str]  # relative path -> sha256
    export_config: dict[str, Any] = field(default_factory=dict)
    # Sampling defaults for requests that leave a field out, and where each came from (the checkpoint's
    # generation_config.json or the export YAML): {"temperature": {"value": 0.2, "source": "..."}}.
    generation_defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    exported_with: dict[str, str] = field(default_factory=dict)  # package -> version, for `pagedgraph inspect`
    quantization: str = "none"  # model.quantization: none | gguf | w8a16 | w4a16 | w8a8 | gptq | awq
    weight_formats: dict[str, int] = field(default_factory=dict)  # checkpoint tensors per form: {"Q4_1": 210, ...}
    format_version: int = FORMAT_VERSION
    op_set_version: int = OP_SET_VERSION
    # KV-cache dtypes the artifact has graphs for (kv_variant names them); () in older artifacts: `dtype` only.
    kv_cache_dtypes: tuple[str, ...] = ()
    # export.tensor_parallel_size: with more than one rank, every graph file is per rank (`ranks`); the embedding,
    # the LM head and the norms are replicated on each.
    tensor_parallel_size: int = 1
    ranks: tuple[RankLayout, ...] = ()

    @property
    def served_kv_cache_dtypes(self) -> tuple[str, ...]:
        return self.kv_cache_dtypes or (self.dtype,)

    def kv_cache_dtype(self, requested: str, artifact: Path | str = "the artifact") -> str:
        """`requested` (a cache dtype or "auto": the compute dtype) if the artifact has its graphs, else a clear error."""
        dtype = self.dtype if requested == "auto" else requested
        if dtype not in self.served_kv_cache_dtypes:
            raise ArtifactError(
                f"kv_cache.dtype = {requested!r}: {artifact} has graphs for the KV-cache dtypes "
                f"{list(self.served_kv_cache_dtypes)}; choose one of them (or auto), or re-export with {dtype} in "
                f"export.kv_cache_dtypes")
        return dtype

    def graph_for(self, family: str, kv_cache_dtype: str, rank: int | None = None) -> str:
        """The graph file of `family` whose pools hold `kv_cache_dtype` (rank `rank`'s with tensor parallelism)."""
        graph = kv_variant(self.families[family].graph, kv_cache_dtype, self.dtype)
        return graph if rank is None else rank_file(graph, self.ranks[rank].folder)

    def served_graph(self, kv_cache_dtype: str, rank: int | None = None) -> str:
        """The one graph file that serves every family with pools of `kv_cache_dtype` (rank `rank`'s with tensor
        parallelism): what an executor loads; an error if the families have graphs of their own."""
        graphs = {self.graph_for(family, kv_cache_dtype, rank) for family in self.families}
        if len(graphs) != 1:
            raise ValueError(f"expected one graph shared by all families, got {sorted(graphs)}")
        return graphs.pop()

    @property
    def block_quantized(self) -> bool:
        """Whether some linears run as `Linear.block_quantized` (ONNX: MatMulNBits): every quantization but none
        stores some so (w8a8 its down_proj and LM head); float32 and bfloat16 weights run dense linears only."""
        return self.quantization != "none"

    @property
    def ladder_plan(self) -> dict[str, Any] | None:
        """export.buckets.plan: the traffic `pagedgraph plan` fitted the ladders to and the padding it expects;
        None for hand-picked ladders."""
        return self.export_config.get("export", {}).get("buckets", {}).get("plan")

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """The generation defaults' values, under SamplingParams' names."""
        return {name: entry["value"] for name, entry in self.generation_defaults.items()}

    def to_json(self) -> str:
        data = asdict(self)
        for family in data["families"].values():
            family["gears"] = [[g["tokens"], g["seqs"], g["blocks"]] for g in family["gears"]]
        return json.dumps(data, indent=2)

    @classmethod
    def load(cls, artifact: Path, verify: bool = True) -> "Manifest":
        path = Path(artifact) / MANIFEST
        if not path.is_file():
            raise ArtifactError(not_an_artifact(Path(artifact)))
        redo = re_export_hint(Path(artifact))
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
                generation_defaults=dict(data.get("generation_defaults", {})),
                exported_with=dict(data.get("exported_with", {})),
                quantization=data.get("quantization", "none"),
                weight_formats=dict(data.get("weight_formats", {})),
                format_version=int(data["format_version"]),
                op_set_version=int(data["op_set_version"]),
                kv_cache_dtypes=tuple(data.get("kv_cache_dtypes", ())),
                tensor_parallel_size=int(data.get("tensor_parallel_size", 1)),
                ranks=tuple(RankLayout.from_dict(r) for r in data.get("ranks", ())),
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

    def precision(self) -> str:
        """One line for logs and reports: "float32, quantization gguf (Q4_1 x210, Q8_0 x1, float32 x61)"."""
        forms = ", ".join(f"{form} x{count}" for form, count in self.weight_formats.items())
        return f"{self.dtype}, quantization {self.quantization}" + (f" ({forms})" if forms else "")


def re_export_hint(artifact: Path) -> str:
    """The command that rebuilds a damaged or outdated artifact in place, from the config it was made with."""
    config = artifact / "export_config.json"
    given = shlex.quote(str(config)) if config.is_file() else "<export.yaml>"
    return f"re-export it with `pagedgraph export --config {given} --out {shlex.quote(str(artifact))}`"


CHECKPOINT = "<checkpoint>: a Hugging Face checkpoint directory or a .gguf file"


def not_an_artifact(path: Path) -> str:
    """Why `path` is no artifact, with an export command that is safe to run as written (it never writes into
    `path` unless `path` is missing or empty, so a checkpoint or a config folder is never overwritten)."""
    quoted = shlex.quote(str(path))
    if not path.exists():
        return (f"{path} does not exist; export an artifact there with "
                f"`pagedgraph export --model <checkpoint> --out {quoted}` ({CHECKPOINT})")
    if (path.is_file() and path.suffix.lower() == ".gguf") or (path / "config.json").is_file():
        kind = "a GGUF file" if path.is_file() else "a Hugging Face checkpoint"
        return (f"{path} is {kind}, not a pagedgraph artifact; export it first: `pagedgraph export --model {quoted} "
                f"--out {shlex.quote(str(fresh_sibling(path)))}`, then pass that --out directory")
    if path.is_file():
        return f"{path} is a file, not a pagedgraph artifact directory (one holding {MANIFEST})"
    held = contents(path)
    if not held:
        return (f"{path} is an empty directory, not a pagedgraph artifact; export one into it with "
                f"`pagedgraph export --model <checkpoint> --out {quoted}` ({CHECKPOINT})")
    return (f"{path} is not a pagedgraph artifact (no {MANIFEST}; it holds {held}); export one into a new "
            f"directory: `pagedgraph export --model <checkpoint> --out {shlex.quote(str(fresh_sibling(path)))}` "
            f"({CHECKPOINT})")


def contents(directory: Path, shown: int = 4) -> str:
    """A few of the entries in `directory`, for messages ("" when it is empty)."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def fresh_sibling(path: Path) -> Path:
    """A path next to `path` that does not exist yet: a safe --out to suggest."""
    base = path.parent / f"{path.stem if path.is_file() else path.name}-pagedgraph"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def kv_variant(graph: str, kv_cache_dtype: str, compute_dtype: str) -> str:
    """`graph`'s file for pools of `kv_cache_dtype`: the graph itself for the compute dtype, else
    `<stem>.kv-<dtype>.onnx` beside it (same inputs, pools typed by the cache dtype, weights shared)."""
    if kv_cache_dtype == compute_dtype:
        return graph
    stem, _, ext = graph.rpartition(".")
    return f"{stem}.kv-{kv_cache_dtype}.{ext}"


def rank_folder(path: str, rank: int) -> str:
    """Rank `rank`'s folder under `path`'s top folder: `graphs/model.onnx` -> `graphs/rank1`."""
    return f"{path.partition('/')[0]}/rank{rank}"


def rank_file(path: str, folder: str) -> str:
    """`path` (under graphs/) in a rank's `folder`: `graphs/mindir/index.json` in `graphs/rank1` ->
    `graphs/rank1/mindir/index.json`."""
    return f"{folder}/{path.partition('/')[2]}"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
