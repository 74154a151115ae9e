"""MindSpore executor: the CPU MINDIR graph of each gear, run through nn.GraphCell, pools updated in place.

An `Executor` (runtime/executors.py). The KVPools' arrays and the weights are wrapped once with
Tensor.from_numpy (no copy): the graphs' C++ kernels write the pools in place, and every gear
reads the one memory-mapped copy of the weights. A gear's graph is loaded and compiled on its
first step (seconds for a 30-layer model), after binding the MINDIR to this process: the pool
rows set to this pool's size and the kernels' library path to this machine's build.
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ..artifact.manifest import ArtifactError, Manifest
from ..artifact.mindir import MindirIndex, import_mindspore
from ..graphs.contract import Gear
from ..cpu_kernels.binding import set_threads
from ..cpu_kernels.build import library_path
from .kv_pools import KVPools


class MindSporeExecutor:
    def __init__(self, artifact: Path, manifest: Manifest, pools: KVPools, threads: int | None = None) -> None:
        self.ms = import_mindspore("executor 'mindspore'")
        self.artifact = Path(artifact)
        self.index = MindirIndex.load(self.artifact)
        if self.index.target != "cpu":
            raise ArtifactError(f"{artifact} holds MINDIR graphs for {self.index.target!r}, which run only there; "
                                f"export with `--format onnx,mindir --target cpu` to run them here")
        if threads:
            set_threads(threads)
        self.library = library_path()
        # Like OrtExecutor's, for reports; None: not an ONNX Runtime setting, the MINDIR graphs call the kernels.
        self.custom_ops: bool | None = None
        self.pools = pools
        tensor = self.ms.Tensor
        self._pool_tensors = {name: tensor.from_numpy(pool) for name, pool in pools.items()}
        self._weights = {name: tensor.from_numpy(w) for name, w in self.index.read_weights(self.artifact).items()}
        self._families = {gear: family for family, spec in manifest.families.items() for gear in spec.gears}
        self._cells: dict[Gear, tuple[Any, tuple[Any, ...]]] = {}
        self._scratch = tempfile.TemporaryDirectory(prefix="pagedgraph-mindir-")

    def _bind(self, graph: str) -> Path:
        """A copy of `graph` whose pool inputs have this pool's rows and whose kernels are this build."""
        from mindspore.train.mind_ir_pb2 import ModelProto

        proto = ModelProto()
        proto.ParseFromString((self.artifact / graph).read_bytes())
        pools = set(self.pools)
        for value in proto.graph.input:
            if value.name.split(":")[-1] in pools:
                value.tensor[0].dims[0] = self.pools.num_slots
        for primitive in proto.primitives:
            for attribute in primitive.attribute:
                if attribute.name in ("func_name", "uniq_name") and b".so:" in attribute.s:
                    function = attribute.s.decode().rpartition(".so:")
                    head = "Custom__" if attribute.name == "uniq_name" else ""
                    attribute.s = f"{head}{self.library}:{function[2]}".encode()
        bound = Path(self._scratch.name) / Path(graph).name
        bound.write_bytes(proto.SerializeToString())
        return bound

    def _cell(self, gear: Gear, inputs: dict[str, np.ndarray]) -> tuple[Any, tuple[Any, ...]]:
        cached = self._cells.get(gear)
        if cached is None:
            graph = self.index.graph(self._families[gear], gear)
            cell = self.ms.nn.GraphCell(self.ms.load(str(self._bind(graph))))
            tensor = self.ms.Tensor
            args = tuple(tensor.from_numpy(inputs[name]) if name in inputs else self._pool_tensors[name]
                         for name in self.index.inputs) + tuple(self._weights[name]
                                                                for name in self.index.weight_inputs[self.index.dtype])
            cached = self._cells[gear] = (cell, args)
        return cached

    def run(self, gear: Gear, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Run one step; `inputs` must be the packer's buffers for this gear (wrapped once, by identity)."""
        cell, args = self._cell(gear, inputs)
        return cell(*args).asnumpy()
