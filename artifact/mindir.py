"""The MINDIR part of an artifact: one static graph per gear plus one shared weights file, described
by graphs/mindir/index.json (written by exporter/mindspore, read by runtime/executor_mindspore).

MindSpore graphs are static, so the pools' leading dimension is exported at a nominal size and
bound to the runtime's pool size when a graph is loaded. The weights file uses MindSpore's
external-data layout (a 64-byte header whose first byte says little-endian, then 64-byte aligned
tensors). Graphs of both targets take the weights as inputs after the contract inputs and pools (the
order is `weight_inputs`), so one copy, mapped or on the device, is bound to every gear.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .manifest import ArtifactError
from ..graphs.contract import Gear

DIRECTORY = "graphs/mindir"
INDEX = f"{DIRECTORY}/index.json"
WEIGHTS = f"{DIRECTORY}/weights.data"
HEADER_BYTES = 64
ALIGN = 64


@dataclass(frozen=True)
class WeightEntry:
    offset: int
    shape: tuple[int, ...]
    dtype: str | None = None  # None: the index's dtype (int8 KV-cache parameters have their own)


@dataclass(frozen=True)
class MindirIndex:
    target: str
    dtype: str
    inputs: tuple[str, ...]  # the first graph arguments of every gear, in call order: contract inputs and pools
    weights: dict[str, WeightEntry]  # every weight in WEIGHTS, each once
    pool_shape: tuple[int, ...]  # one pool as exported; dimension 0 (slots or blocks) is bound at load
    graphs: dict[str, dict[str, str]]  # family -> gear_key(gear) -> graph file, relative to the artifact
    # KV-cache dtype -> graphs like `graphs` whose pools hold it (Ascend int8); `graphs` hold the `dtype` cache.
    kv_cache_graphs: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    # KV-cache dtype -> the weights its graphs (every family) take after `inputs`, in call order
    weight_inputs: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, artifact: Path) -> "MindirIndex":
        path = Path(artifact) / INDEX
        if not path.is_file():
            raise ArtifactError(f"{artifact} has no MINDIR graphs ({INDEX} missing); re-export it with "
                                f"`pagedgraph export --config <export.yaml> --format onnx,mindir --target cpu`")
        data = json.loads(path.read_text())
        return cls(target=data["target"], dtype=data["dtype"], inputs=tuple(data["inputs"]),
                   weights={k: WeightEntry(v["offset"], tuple(v["shape"]), v.get("dtype"))
                            for k, v in data["weights"].items()},
                   pool_shape=tuple(data["pool_shape"]), graphs=data["graphs"],
                   kv_cache_graphs=data.get("kv_cache_graphs", {}),
                   weight_inputs={k: tuple(v) for k, v in data.get("weight_inputs", {}).items()}
                   or {data["dtype"]: tuple(data["weights"])})  # before weight_inputs: one set, in this order

    def arguments(self, kv_cache_dtype: str | None = None) -> tuple[str, ...]:
        """Every graph argument of the `kv_cache_dtype` graphs (None: the index's dtype), in call order."""
        return self.inputs + self.weight_inputs[kv_cache_dtype or self.dtype]

    def graph(self, family: str, gear: Gear, kv_cache_dtype: str | None = None) -> str:
        """The graph of `family` and `gear` whose pools hold `kv_cache_dtype` (None: the index's dtype)."""
        if kv_cache_dtype in (None, self.dtype):
            graphs = self.graphs
        elif kv_cache_dtype in self.kv_cache_graphs:
            graphs = self.kv_cache_graphs[kv_cache_dtype]
        else:
            raise ArtifactError(f"no MINDIR graphs for a {kv_cache_dtype} KV cache; the MINDIR holds "
                                f"{[self.dtype, *self.kv_cache_graphs]} caches")
        try:
            return graphs[family][gear_key(gear)]
        except KeyError:
            raise ArtifactError(f"no MINDIR graph for {family} gear {gear_key(gear)}; the artifact's MINDIR gears "
                                f"are {sorted(graphs.get(family, {}))}") from None

    def read_weights(self, artifact: Path) -> dict[str, np.ndarray]:
        """Every weight as a read-only view of one memory map of the weights file."""
        data = np.memmap(Path(artifact) / WEIGHTS, dtype=np.uint8, mode="r")
        return {name: np.ndarray(e.shape, numpy_dtype(e.dtype or self.dtype), data, e.offset)
                for name, e in self.weights.items()}


INT4X2 = "qint4x2"  # MindSpore's packed int4 (two codes a byte, the even one in the low nibble), stored as int8


def numpy_dtype(name: str) -> np.dtype:
    """A weight dtype by its name: bfloat16 (ml_dtypes), qint4x2's bytes (int8), or numpy's."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(np.int8) if name == INT4X2 \
        else np.dtype(name)


def gear_key(gear: Gear) -> str:
    return f"T{gear.tokens}_B{gear.seqs}_M{gear.blocks}"


def write_weights(path: Path, weights: Iterable[tuple[str, np.ndarray]], append: bool = False
                  ) -> dict[str, WeightEntry]:
    """Write `weights` in MindSpore's external-data layout, one array at a time as the iterable yields it
    (so a lazy source keeps one tensor in memory); `append` adds to a file this wrote. Returns where each lies."""
    entries = {}
    with open(path, "ab" if append else "wb") as f:
        if not append:
            f.write((1).to_bytes(1, "little") + bytes(HEADER_BYTES - 1))
        for name, array in weights:
            entries[name] = WeightEntry(f.tell(), tuple(array.shape), array.dtype.name)
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
            f.write(bytes(-f.tell() % ALIGN))
    return entries


def import_mindspore(purpose: str) -> Any:
    """MindSpore in GRAPH_MODE on the host CPU, or an error saying how to install it (an optional extra)."""
    try:
        import mindspore
    except ImportError as exc:
        raise RuntimeError(f"{purpose} needs MindSpore ({exc}); install it with `pip install -e .[mindspore]` "
                           f"(MindSpore 2.10 needs numpy<2)") from None
    mindspore.set_context(mode=mindspore.GRAPH_MODE, device_target="CPU")
    return mindspore
