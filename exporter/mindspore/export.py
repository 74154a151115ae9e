"""Export one static MINDIR per gear from graphs/llama.py, plus the shared weights file and index.

Target "cpu": float32, the fused ops are pagedgraph's C++ kernels (AOT custom ops), weights are
graph inputs so one copy in memory serves every gear. Target "ascend": float16, MindSpore's own
ATB-backed primitives, weights are Parameters whose data lives once in the shared weights file.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from artifact.mindir import (DIRECTORY, INDEX, WEIGHTS, MindirIndex, gear_key, import_mindspore,
                             write_weights)
from exporter.checkpoint.base import Checkpoint
from exporter.mindspore.builder import MindSporeBuilder, MindSporeTarget, load_cell_class, weight_attribute
from graphs import contract as c
from graphs import llama
from graphs.contract import DECODE, Gear

DTYPES = {"cpu": np.float32, "ascend": np.float16}


def write_mindir(checkpoint: Checkpoint, gears: dict[str, tuple[Gear, ...]], max_positions: int, block_size: int,
                 target: str, out: Path, log: TextIO) -> MindirIndex:
    """Write graphs/mindir/ under `out` for every gear; returns the index it wrote."""
    ms = import_mindspore("--format mindir")
    model = checkpoint.config
    dtype = DTYPES[target]
    weights = {k: w.astype(dtype) for k, w in llama.graph_weights(model, checkpoint.tensors, max_positions).items()}
    (out / DIRECTORY).mkdir(parents=True, exist_ok=True)
    entries = write_weights(out / WEIGHTS, weights)
    num_blocks = max(g.blocks for family in gears.values() for g in family) + 1  # nominal; bound at load
    pool_shape = ((num_blocks * block_size, model.kv_size) if target == "cpu"
                  else (num_blocks, block_size, model.num_kv_heads, model.head_dim))
    graphs: dict[str, dict[str, str]] = {}
    inputs: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pagedgraph-mindir-") as scratch:
        for family, family_gears in gears.items():
            cell, builder = _bucket_cell(model, block_size, target, family, weights, Path(scratch))
            inputs = builder.inputs
            for gear in family_gears:
                started = time.perf_counter()
                rel = f"{DIRECTORY}/{family}_{gear_key(gear)}.mindir"
                args = _example_args(ms, gear, builder, pool_shape, dtype, weights)
                _export(ms, cell, args, out / rel, entries if target == "ascend" else None)
                graphs.setdefault(family, {})[gear_key(gear)] = rel
                print(f"mindir {target} {family} {gear_key(gear)} ({time.perf_counter() - started:.1f}s)", file=log)
    weight_order = {name: entries[name] for name in builder.weights}
    index = MindirIndex(target=target, dtype=np.dtype(dtype).name, inputs=tuple(inputs), weights=weight_order,
                        pool_shape=pool_shape, graphs=graphs)
    (out / INDEX).write_text(index.to_json())
    return index


def _bucket_cell(model: Any, block_size: int, target: str, family: str, weights: dict[str, np.ndarray],
                 scratch: Path) -> tuple[Any, MindSporeBuilder]:
    """Record llama.build against the target's lowering and instantiate the generated Cell."""
    if target == "cpu":
        from exporter.mindspore.cpu_ops import MINDSPORE_CPU
        from kernels.build import library_path

        lowering, ms_target = MINDSPORE_CPU, MindSporeTarget("cpu", library=library_path())
    else:
        from exporter.mindspore.ascend_ops import MINDSPORE_ASCEND, Float32Logits

        lowering, ms_target = MINDSPORE_ASCEND, MindSporeTarget("ascend", multi_query=family != DECODE,
                                                                logits=Float32Logits)
    builder = MindSporeBuilder(lowering, ms_target, weights_as_inputs=target == "cpu")
    llama.build(builder, model, block_size)
    cell = load_cell_class(builder.source(), scratch / f"{target}_{family}.py")(builder.cells)
    if target == "ascend":
        from mindspore import Parameter
        from mindspore.common.initializer import initializer

        for name in builder.weights:  # shapes only: the data is written once, to the shared weights file
            w = weights[name]
            setattr(cell, weight_attribute(name), Parameter(initializer("zeros", w.shape, _ms_dtype(w.dtype)),
                                                            name=name))
    return cell, builder


def _ms_dtype(dtype: np.dtype) -> Any:
    from mindspore import dtype as mstype

    return {np.dtype(np.float32): mstype.float32, np.dtype(np.float16): mstype.float16}[np.dtype(dtype)]


def _example_args(ms: Any, gear: Gear, builder: MindSporeBuilder, pool_shape: tuple[int, ...], dtype: type,
                  weights: dict[str, np.ndarray]) -> list[Any]:
    """Zero tensors of the gear's shapes, in the graph's argument order (values are never run)."""
    shapes = gear.input_shapes()
    args = [ms.Tensor(np.zeros(shapes[n], c.INPUT_DTYPES[n])) if n in shapes else ms.Tensor(np.zeros(pool_shape, dtype))
            for n in builder.inputs]
    if builder.weights_as_inputs:
        args += [ms.Tensor(weights[w]) for w in builder.weights]
    return args


def _export(ms: Any, cell: Any, args: list[Any], path: Path, entries: dict[str, Any] | None) -> None:
    """ms.export, then (Ascend) point every Parameter at the shared weights file instead of a private copy."""
    from mindspore.train.mind_ir_pb2 import ModelProto

    stashed: list[Any] = []

    def drop_parameters(model: Any) -> None:  # runs before MindSpore serialises parameter data
        stashed.extend(model.graph.parameter)
        del model.graph.parameter[:]

    ms.export(cell, *args, file_name=str(path), file_format="MINDIR",
              custom_func=drop_parameters if entries is not None else None)
    os.chmod(path, 0o644)  # MindSpore leaves its files owner-read-only
    if entries is None:
        return
    proto = ModelProto()
    proto.ParseFromString(path.read_bytes())
    for parameter in stashed:
        name = parameter.name.split(":")[-1]
        parameter.ClearField("raw_data")
        parameter.external_data.location = Path(WEIGHTS).name
        parameter.external_data.offset = entries[name].offset
        parameter.external_data.length = int(np.prod(entries[name].shape)) * 2
        proto.graph.parameter.append(parameter)
    path.write_bytes(proto.SerializeToString())
