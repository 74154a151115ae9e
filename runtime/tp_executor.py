"""Tensor-parallel rank graphs run in one process: the single-process simulation of their AllReduce.

Each rank's graph (graphs/rank<r>/model.onnx) holds AllReduce nodes without a body (exporter/onnx/lowering.py),
which ONNX Runtime refuses to run alone. The simulation splits every rank graph at them into stages, runs stage k
on every rank, sums the ranks' partials (rank 0 first: one order of addition on every run) and hands the total to
every rank's stage k + 1. A collective kernel registered for the node (NCCL, gloo, HCCL) would run the same graphs
whole, one process per rank; nothing in the artifact changes. The split is this module's alone.

A functional model of tensor parallelism (tests, checking an artifact before it goes to devices), not a fast
path: a step is 2 x layers + 1 session runs per rank, and the values crossing stages are copied.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from ..artifact.manifest import Manifest
from ..graphs import contract as c
from ..graphs import ops
from ..graphs.contract import Gear
from ..cpu_kernels.int8_gemm import EXTERNAL_FOLDER, fit_int8_gemm
from .executor_ort import CustomOps, pool_values, register_custom_ops, run_options, session_options
from .kv_pools import KVPools


@dataclass(frozen=True)
class Stage:
    """The nodes between two AllReduce nodes; what they read from outside (graph inputs, earlier stages' values,
    reduced totals) and what they hand on (values read later, the partial to reduce, graph outputs)."""

    nodes: tuple[onnx.NodeProto, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    reduce: tuple[str, str] | None  # (partial, total) of the AllReduce that follows; None after the last


def split_stages(graph: onnx.GraphProto) -> list[Stage]:
    """`graph` (nodes in topological order, as exported) cut at its AllReduce nodes."""
    groups: list[list[onnx.NodeProto]] = [[]]
    reductions: list[tuple[str, str]] = []
    for node in graph.node:
        if node.domain == ops.OP_SET_DOMAIN and node.op_type == ops.ALL_REDUCE.name:
            reductions.append((node.input[0], node.output[0]))
            groups.append([])
        else:
            groups[-1].append(node)
    weights = {i.name for i in graph.initializer}
    produced = {out: k for k, group in enumerate(groups) for node in group for out in node.output if out}
    reads: list[tuple[str, ...]] = []
    handed: list[set[str]] = [set() for _ in groups]
    for k, group in enumerate(groups):
        own = {out for node in group for out in node.output}
        names = tuple(dict.fromkeys(i for node in group for i in node.input if i and i not in own and i not in weights))
        reads.append(names)
        for name in names:
            if name in produced:
                handed[produced[name]].add(name)
    for name in [partial for partial, _ in reductions] + [o.name for o in graph.output]:
        if name in produced:
            handed[produced[name]].add(name)
    return [Stage(tuple(group), reads[k], tuple(sorted(handed[k])), reductions[k] if k < len(reductions) else None)
            for k, group in enumerate(groups)]


def stage_model(model: onnx.ModelProto, stage: Stage) -> onnx.ModelProto:
    """One stage as a model: the graph's inputs, outputs and weights it uses (weights still referencing the rank's
    file), and the values crossing stages typed by their producer (a Constant's dtype, else float32: activations)."""
    graph = model.graph
    declared = {v.name: v for v in (*graph.input, *graph.output)}
    constants = {node.output[0]: node.attribute[0].t.data_type for node in graph.node
                 if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value"}

    def info(name: str) -> onnx.ValueInfoProto:
        return declared.get(name) or helper.make_tensor_value_info(name, constants.get(name, TensorProto.FLOAT), None)

    used = {i for node in stage.nodes for i in node.input}
    body = helper.make_graph(list(stage.nodes), graph.name, [info(n) for n in stage.inputs],
                             [info(n) for n in stage.outputs], [w for w in graph.initializer if w.name in used])
    return helper.make_model(body, opset_imports=list(model.opset_import), functions=list(model.functions),
                             ir_version=model.ir_version, producer_name=model.producer_name)


class RankGraph:
    """One rank's graph as a session per stage; `pools` (its KV pools as OrtValues) are bound as the inputs and the
    aliased outputs of its cache writes, so they are written in place as in the whole graph; `folder` holds its
    external weights."""

    def __init__(self, model: onnx.ModelProto, options: ort.SessionOptions,
                 pools: Mapping[str, ort.OrtValue] | None = None, folder: Path | None = None) -> None:
        if folder is not None:  # where every stage's session reads its external weights (shifted ones included)
            options.add_session_config_entry(EXTERNAL_FOLDER, str(fit_int8_gemm(model, folder).external_folder(folder)))
        self.stages = split_stages(model.graph)
        self._pools = dict(pools or {})
        self._pool_of = {c.cache_output_name(name): name for name in self._pools}
        self._sessions = [ort.InferenceSession(stage_model(model, s).SerializeToString(), options,
                                               providers=["CPUExecutionProvider"]) if s.nodes else None
                          for s in self.stages]

    def run(self, k: int, values: dict[str, np.ndarray], options: ort.RunOptions | None = None) -> None:
        """Stage `k` over `values` (name -> array), which gains what the stage hands on."""
        session, stage = self._sessions[k], self.stages[k]
        if session is None:
            return
        binding = session.io_binding()
        for name in stage.inputs:
            if name in self._pools:
                binding.bind_ortvalue_input(name, self._pools[name])
            else:
                binding.bind_cpu_input(name, values[name])
        handed = [name for name in stage.outputs if name not in self._pool_of]
        for name in handed:
            binding.bind_output(name)
        for name in stage.outputs:
            if name in self._pool_of:
                binding.bind_ortvalue_output(name, self._pools[self._pool_of[name]])
        session.run_with_iobinding(binding, options)
        for name, value in zip(handed, binding.get_outputs()):
            values[name] = value.numpy()


def run_ranks(ranks: Sequence[RankGraph], feeds: Sequence[Mapping[str, np.ndarray]],
              options: ort.RunOptions | None = None) -> list[dict[str, np.ndarray]]:
    """Every stage on every rank, each AllReduce as the sum of the ranks' partials: each rank's values at the end."""
    values = [dict(feed) for feed in feeds]
    for k, stage in enumerate(ranks[0].stages):
        for rank, own in zip(ranks, values):
            rank.run(k, own, options)
        if stage.reduce is not None:
            partial, total = stage.reduce
            summed = values[0][partial].astype(np.float32, copy=True)
            for own in values[1:]:
                summed += own[partial]
            for own in values:
                own[total] = summed
    return values


class TensorParallelExecutor:
    """An `Executor` (runtime/executors.py) over an artifact exported with export.tensor_parallel_size > 1: every
    rank's graph in this process, each over its own KV pools (`pools.rank(r)`: its KV heads only)."""

    def __init__(self, artifact: Path, manifest: Manifest, pools: KVPools, threads: int | None = None,
                 custom_ops: CustomOps = "auto") -> None:
        self.pools = pools
        self.ranks = []
        for rank in range(manifest.tensor_parallel_size):
            path = Path(artifact) / manifest.served_graph(pools.kv_cache_dtype, rank)
            options = session_options(threads)
            self.custom_ops = register_custom_ops(options, custom_ops)
            self.ranks.append(RankGraph(onnx.load_model(path, load_external_data=False), options,
                                        pool_values(pools, rank), path.parent))
        self._run_options = run_options()
        self._output = c.head_output(manifest.model)[0]

    def run(self, gear: Gear, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """One step's logits [gear.seqs, vocab] or pooled rows [gear.seqs, hidden] (rank 0's; every rank computes the
        same replicated head)."""
        return run_ranks(self.ranks, [inputs] * len(self.ranks), self._run_options)[0][self._output]
