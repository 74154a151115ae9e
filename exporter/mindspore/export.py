"""Export one static MINDIR per gear from graphs/llama.py, plus the shared weights file and index.

Target "cpu": float32, the fused ops are pagedgraph's C++ kernels (AOT custom ops), weights are
graph inputs so one copy in memory serves every gear. Target "ascend": float16 or bfloat16 (model.dtype;
float16 for float32), MindSpore's own ATB-backed primitives, weights are Parameters whose data lives once
in the shared weights file. Ascend also writes one graph set per further KV-cache dtype (int8: ATB's C8).
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from ...artifact.manifest import kv_variant
from ...artifact.mindir import (DIRECTORY, INDEX, INT4X2, WEIGHTS, MindirIndex, WeightEntry, gear_key,
                                import_mindspore, numpy_dtype, write_weights)
from ..checkpoint.base import Checkpoint
from .builder import MindSporeBuilder, MindSporeTarget, load_cell_class, weight_attribute
from ...graphs import contract as c
from ...graphs import llama
from ...graphs.config import ModelConfig
from ...graphs.contract import DECODE, Gear
from ...graphs.quant import BlockQuantized, Int8PerChannel, graph_arrays, graph_parts, w8a8_static_parts

COMPILE_BYTES = 3 << 30  # one gear's compile working set, beside the weights (docs/performance.md)


@dataclass(frozen=True)
class _Job:
    """What a compile worker needs, picklable: it builds its own cells and reads the weights back from `out`."""

    model: ModelConfig
    forms: llama.WeightForms  # which linears are quantized (Ascend w8a16)
    block_size: int
    target: str
    dtype: str  # compute dtype
    out: str
    scratch: str  # generated Cell sources go here
    entries: dict[str, WeightEntry]
    pool_shape: tuple[int, ...]


@dataclass(frozen=True)
class _Compiled:
    kv_cache_dtype: str
    family: str
    key: str
    rel: str
    inputs: tuple[str, ...]
    weights: tuple[str, ...]


_WORKER: dict[str, Any] = {}  # per process: the job, mindspore, the weights and the cells built so far


def compute_dtype(target: str, model_dtype: str) -> str:
    """The MINDIR's compute dtype: cpu float32; ascend model.dtype, float16 for float32 (ATB's PagedAttention
    has no float32 kernel)."""
    if target == "cpu":
        return "float32"
    return model_dtype if model_dtype in ("float16", "bfloat16") else "float16"


def cache_dtypes(target: str, model_dtype: str, kv_cache_dtypes: tuple[str, ...] | list[str]) -> list[str]:
    """The pool dtypes the MINDIR has graphs for, its compute dtype's first: cpu float32 only (other caches
    are served by the ONNX graphs); ascend the compute dtype (for model.dtype, float32 included) and int8."""
    compute = compute_dtype(target, model_dtype)
    if target == "cpu":
        return [compute]
    return [compute] + (["int8"] if "int8" in kv_cache_dtypes else [])


def write_mindir(checkpoint: Checkpoint, gears: dict[str, tuple[Gear, ...]], max_positions: int, block_size: int,
                 target: str, out: Path, log: TextIO, workers: int | None = None, model_dtype: str = "float32",
                 kv_cache_dtypes: tuple[str, ...] = ("float32",),
                 kv_scales: dict[str, np.ndarray] | None = None,
                 w8a8_inputs: dict[str, tuple[float, int]] | None = None) -> MindirIndex:
    """Write graphs/mindir/ under `out` for every gear and cache dtype; returns the index it wrote.

    `kv_scales`: the calibrated int8 KV-cache parameters (exporter/kv_calibration.py), needed for int8;
    `w8a8_inputs`: the int8 linears' calibrated static input (scale, offset), needed for Ascend W8A8.

    The gears compile in `workers` processes (default: `default_workers`, bounded by the cores and the
    available memory), each building a family's Cell once and reading the weights back from the shared
    weights file; a progress bar with an ETA goes to `log`. The workers are spawned, so a script that
    exports with more than one must call it under `if __name__ == "__main__":` (the CLI does).
    """
    from tqdm import tqdm

    import_mindspore("--format mindir")
    model = checkpoint.config
    dtype = compute_dtype(target, model_dtype)
    caches = cache_dtypes(target, model_dtype, kv_cache_dtypes)
    graph_weights = llama.graph_weights(model, checkpoint.tensors, max_positions)
    forms = llama.WeightForms.of(graph_weights, w8a8_static=w8a8_inputs)
    int4: set[str] = set()
    weights = _target_arrays(graph_weights, dtype, w8a8_inputs or {}, int4)
    del graph_weights
    if "int8" in caches:
        from .ascend_ops import int8_cache_parameters

        if not kv_scales:
            raise ValueError("an int8 KV cache in the Ascend MINDIR needs the calibrated scales (kv_scales)")
        weights.update(int8_cache_parameters(kv_scales, dtype))
    (out / DIRECTORY).mkdir(parents=True, exist_ok=True)
    entries = write_weights(out / WEIGHTS, weights)
    entries.update({name: dataclasses.replace(entries[name], dtype=INT4X2) for name in int4})
    weight_bytes = sum(w.nbytes for w in weights.values())
    del weights  # the workers read them back from the file
    num_blocks = max(g.blocks for family in gears.values() for g in family) + 1  # nominal; bound at load
    pool_shape = ((num_blocks * block_size, model.kv_size) if target == "cpu"
                  else (num_blocks, block_size, model.num_kv_heads, model.head_dim))
    tasks = [(cache, family, gear) for cache in caches for family, family_gears in gears.items()
             for gear in family_gears]
    workers = max(1, min(workers or default_workers(weight_bytes, target), len(tasks)))
    done: dict[tuple[str, str, str], _Compiled] = {}
    with tempfile.TemporaryDirectory(prefix="pagedgraph-mindir-") as scratch, \
            tqdm(total=len(tasks), unit="gear", file=log, mininterval=1.0,
                 desc=f"mindir {target}, {workers} worker{'s' if workers > 1 else ''}") as bar:
        job = _Job(model, forms, block_size, target, dtype, str(out), scratch, entries, pool_shape)
        if workers == 1:
            ms = import_mindspore("--format mindir")
            previous = ms.get_context("jit_config")
            try:
                _start_worker(job)
                for task in tasks:
                    result = _compile(*task)
                    done[result.kv_cache_dtype, result.family, result.key] = result
                    bar.update()
            finally:
                _WORKER.clear()  # the weights' copy and the cells
                ms.set_context(jit_config=previous or {"infer_boost": "off"})
        else:
            # spawn, not fork: MindSpore's runtime threads do not survive a fork
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(workers, context, _start_worker, (job,)) as pool:
                for future in as_completed([pool.submit(_compile, *task) for task in tasks]):
                    result = future.result()
                    done[result.kv_cache_dtype, result.family, result.key] = result
                    bar.update()
    first = next(r for r in done.values() if r.kv_cache_dtype == dtype)
    names = list(dict.fromkeys([*first.weights, *(w for r in done.values() for w in r.weights)]))  # cpu: input order
    graphs = {cache: {family: {gear_key(g): done[cache, family, gear_key(g)].rel for g in family_gears}
                      for family, family_gears in gears.items()} for cache in caches}
    index = MindirIndex(target=target, dtype=dtype, inputs=first.inputs,
                        weights={name: entries[name] for name in names}, pool_shape=pool_shape,
                        graphs=graphs.pop(dtype), kv_cache_graphs=graphs)
    (out / INDEX).write_text(index.to_json())
    return index


def _target_arrays(weights: dict[str, Any], dtype: str, w8a8_inputs: dict[str, tuple[float, int]],
                   int4: set[str]) -> dict[str, np.ndarray]:
    """The graph's parameters in the compute dtype; a block-quantized weight (Ascend w8a16) as the parts its
    Ascend bodies take (ascend_ops.ascend_block_arrays), an int8 one (Ascend w8a8) as MindIE's W8A8 tensors,
    under graphs/quant.py's names. The names of int4 codes (packed, qint4x2) are added to `int4`."""
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if isinstance(w, Int8PerChannel):
            from .ascend_ops import w8a8_static_arrays

            out.update(zip(w8a8_static_parts(name), w8a8_static_arrays(w, *w8a8_inputs[name], dtype)))
            continue
        if not isinstance(w, BlockQuantized):
            out[name] = np.asarray(w).astype(numpy_dtype(dtype))
            continue
        from .ascend_ops import ascend_block_arrays

        gathered = name == "embed"
        if gathered and (w.bits != 8 or w.minimum is not None):
            raise ValueError(f"the {w.bits}-bit embedding ({w.source}): the Ascend gather reads int8 rows without a "
                             "minimum only")
        names, arrays = graph_parts(name, w, gathered), graph_arrays(name, w, gathered)
        parts = ascend_block_arrays(*(None if n is None else arrays[n] for n in names), w.bits, w.block_size, dtype)
        out.update({n: part for n, part in zip(names, parts) if n is not None and part is not None})
        if w.bits == 4:
            int4.add(names[0])
    return out


def default_workers(weight_bytes: int, target: str) -> int:
    """Compile processes: one per core, as many as fit in the available memory. A CPU-target worker holds
    its own copy of the weights (graph inputs of the traced Cell); every worker holds a compile's working
    set, COMPILE_BYTES (measured in docs/performance.md)."""
    per_worker = COMPILE_BYTES + (weight_bytes if target == "cpu" else 0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, _available_memory() // per_worker))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _start_worker(job: _Job) -> None:
    """Process initializer: mindspore and the weights (CPU target: a private copy, as graph inputs).

    Ascend compiles with MindSpore's infer_boost on, as MindFormers serves: its PagedAttention takes an int8
    cache only then."""
    data = np.memmap(Path(job.out) / WEIGHTS, dtype=np.uint8, mode="r")
    views = {name: np.ndarray(e.shape, numpy_dtype(e.dtype or job.dtype), data, e.offset)
             for name, e in job.entries.items()}
    ms = import_mindspore("--format mindir")
    if job.target == "ascend":
        ms.set_context(jit_config={"infer_boost": "on"})
    _WORKER.clear()
    _WORKER.update(job=job, ms=ms, cells={},
                   weights={k: np.array(v) for k, v in views.items()} if job.target == "cpu" else views)


def _compile(kv_cache_dtype: str, family: str, gear: Gear) -> _Compiled:
    """Export one gear's MINDIR for pools of `kv_cache_dtype` (in a worker, or in-process with one worker)."""
    job, ms, weights, cells = _WORKER["job"], _WORKER["ms"], _WORKER["weights"], _WORKER["cells"]
    if (family, kv_cache_dtype) not in cells:
        scratch = Path(job.scratch) / str(os.getpid())
        scratch.mkdir(exist_ok=True)
        cells[family, kv_cache_dtype] = _bucket_cell(job, family, kv_cache_dtype, weights, scratch)
    cell, builder = cells[family, kv_cache_dtype]
    rel = kv_variant(f"{DIRECTORY}/{family}_{gear_key(gear)}.mindir", kv_cache_dtype, job.dtype)
    args = _example_args(ms, gear, builder, job.pool_shape, numpy_dtype(kv_cache_dtype), weights)
    _export(ms, cell, args, Path(job.out) / rel, job.entries if job.target == "ascend" else None)
    return _Compiled(kv_cache_dtype, family, gear_key(gear), rel, tuple(builder.inputs), tuple(builder.weights))


def _bucket_cell(job: _Job, family: str, kv_cache_dtype: str, weights: dict[str, np.ndarray],
                 scratch: Path) -> tuple[Any, MindSporeBuilder]:
    """Record llama.build against the target's lowering and instantiate the generated Cell."""
    if job.target == "cpu":
        from .cpu_ops import MINDSPORE_CPU
        from ...kernels.build import library_path

        lowering, ms_target = MINDSPORE_CPU, MindSporeTarget("cpu", library=library_path(), dtype=job.dtype)
    else:
        from .ascend_ops import MINDSPORE_ASCEND, Float32Logits

        lowering, ms_target = MINDSPORE_ASCEND, MindSporeTarget("ascend", multi_query=family != DECODE,
                                                                logits=Float32Logits, dtype=job.dtype)
    builder = MindSporeBuilder(lowering, ms_target, weights_as_inputs=job.target == "cpu")
    llama.build(builder, job.model, job.block_size, job.forms, kv_cache_dtype)
    cell = load_cell_class(builder.source(), scratch / f"{job.target}_{family}_{kv_cache_dtype}.py")(builder.cells)
    if job.target == "ascend":
        from mindspore import Parameter
        from mindspore import dtype as mstype
        from mindspore.common.initializer import initializer

        for name in builder.weights:  # shapes only: the data is written once, to the shared weights file
            w, entry = weights[name], job.entries[name]
            dtype = getattr(mstype, entry.dtype or np.dtype(w.dtype).name)
            setattr(cell, weight_attribute(name), Parameter(initializer("zeros", w.shape, dtype), name=name))
    return cell, builder


def _example_args(ms: Any, gear: Gear, builder: MindSporeBuilder, pool_shape: tuple[int, ...], pool_dtype: np.dtype,
                  weights: dict[str, np.ndarray]) -> list[Any]:
    """Zero tensors of the gear's shapes, in the graph's argument order (values are never run)."""
    shapes = gear.input_shapes()
    args = [ms.Tensor(np.zeros(shapes[n], c.INPUT_DTYPES[n])) if n in shapes
            else ms.Tensor(np.zeros(pool_shape, pool_dtype)) for n in builder.inputs]
    if builder.weights_as_inputs:
        args += [ms.Tensor(weights[w]) for w in builder.weights]
    return args


def _export(ms: Any, cell: Any, args: list[Any], path: Path, entries: dict[str, WeightEntry] | None) -> None:
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
        entry = entries[parameter.name.split(":")[-1]]
        parameter.ClearField("raw_data")
        parameter.external_data.location = Path(WEIGHTS).name
        parameter.external_data.offset = entry.offset
        parameter.external_data.length = int(np.prod(entry.shape)) * numpy_dtype(entry.dtype or "float16").itemsize
        proto.graph.parameter.append(parameter)
    path.write_bytes(proto.SerializeToString())
