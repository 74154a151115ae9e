"""Export one static MINDIR per gear of a model's graph (graphs/models), plus the shared weights file and index.

Target "cpu": float32, the fused ops are pagedgraph's C++ kernels (AOT custom ops). Target "ascend": float16 or
bfloat16 (model.dtype; float16 for float32), MindSpore's own ATB-backed primitives, and one graph set per further
KV-cache dtype (int8: ATB's C8). On both, the weights are graph inputs after the contract inputs and pools, so
every gear reads the one copy the caller binds (a Parameter would be a private copy per loaded GraphCell), and
the MINDIR files hold no weight data: the weights are written once, one tensor at a time, to the weights file.
"""
from __future__ import annotations

import dataclasses
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, TextIO

import numpy as np

from ...artifact.manifest import kv_variant, rank_file, rank_folder
from ...artifact.mindir import (DIRECTORY, INDEX, INT4X2, WEIGHTS, MindirIndex, WeightEntry, gear_key,
                                import_mindspore, numpy_dtype, write_weights)
from ..checkpoint.base import Checkpoint
from ..progress import stage_bar
from .builder import MindSporeBuilder, MindSporeTarget, load_cell_class
from ...graphs import contract as c
from ...graphs import models
from ...graphs.config import ModelConfig
from ...graphs.contract import DECODE, Gear
from ...graphs.family import GraphOptions
from ...graphs.quant import (BlockQuantized, ExpertStack, Int8PerChannel, Weight, graph_arrays, graph_parts,
                             stacked_graph_arrays, w8a8_static_parts)
from ...graphs.tensor_parallel import RankShard, rank_config
from ...graphs.weight_forms import WeightForms
from ..tensor_parallel import ShardedWeights

COMPILE_BYTES = 3 << 30  # one gear's compile working set, beside the weights (docs/performance.md)


@dataclass(frozen=True)
class _Job:
    """What a compile worker needs, picklable: it builds its own cells; the weights' shapes and dtypes are all
    it reads of them (the example arguments of an export are never run)."""

    model: ModelConfig
    forms: WeightForms  # which linears are quantized (Ascend w8a16)
    block_size: int
    target: str
    dtype: str  # compute dtype
    out: str
    scratch: str  # generated Cell sources go here
    entries: dict[str, WeightEntry]
    pool_shape: tuple[int, ...]
    directory: str  # the graphs' folder in the artifact: DIRECTORY, or a tensor-parallel rank's
    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class _Compiled:
    kv_cache_dtype: str
    family: str
    key: str
    rel: str
    inputs: tuple[str, ...]
    weights: tuple[str, ...]


_WORKER: dict[str, Any] = {}  # per process: the job, mindspore and the cells built so far


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
                 w8a8_inputs: dict[str, tuple[float, int]] | None = None,
                 shard: RankShard | None = None) -> MindirIndex:
    """Write graphs/mindir/ under `out` for every gear and cache dtype; returns the index it wrote. With a
    tensor-parallel `shard`, rank shard.rank's graphs (its weights; an AllReduce after o_proj and down: HCCL on
    Ascend) in its folder, graphs/rank<r>/mindir/.

    `kv_scales`: the calibrated int8 KV-cache parameters (exporter/kv_calibration.py), needed for int8;
    `w8a8_inputs`: the int8 linears' calibrated static input (scale, offset), needed for Ascend W8A8.

    The weights are converted and written one at a time (memory bounded by the largest tensor, as far as
    `checkpoint.tensors` is lazy). The gears compile in `workers` processes (default: `default_workers`, bounded
    by the cores and the available memory), each building a family's Cell once and exporting it per gear with
    data-free example arguments; a progress bar with an ETA goes to `log`. The workers are spawned, so a script that
    exports with more than one must call it under `if __name__ == "__main__":` (the CLI does).
    """
    import_mindspore("--format mindir")
    model = checkpoint.config
    dtype = compute_dtype(target, model_dtype)
    caches = cache_dtypes(target, model_dtype, kv_cache_dtypes)
    if "int8" in caches and not kv_scales:
        raise ValueError("an int8 KV cache in the Ascend MINDIR needs the calibrated scales (kv_scales)")
    graph_weights: Mapping[str, Weight] = models.graph_weights(model, checkpoint.tensors, max_positions)
    size, (directory, weights_file, index_file) = 1, (DIRECTORY, WEIGHTS, INDEX)
    if shard is not None:
        graph_weights = ShardedWeights(graph_weights, model, shard)
        folder = rank_folder(DIRECTORY, shard.rank)
        size, (directory, weights_file, index_file) = shard.size, (rank_file(p, folder) for p in (DIRECTORY, WEIGHTS,
                                                                                                 INDEX))
    forms = WeightForms.of(graph_weights, w8a8_static=w8a8_inputs)
    (out / directory).mkdir(parents=True, exist_ok=True)
    int4: set[str] = set()
    with stage_bar(log, len(graph_weights), "mindir weights", "tensor", unit_scale=False) as bar:
        entries = write_weights(out / weights_file, _target_arrays(graph_weights, target, dtype, w8a8_inputs or {}, int4,
                                                                   bar))
    del graph_weights
    entries.update({name: dataclasses.replace(entries[name], dtype=INT4X2) for name in int4})
    if "int8" in caches:
        from .ascend_ops import int8_cache_parameters

        entries.update(write_weights(out / weights_file, int8_cache_parameters(kv_scales, dtype).items(), append=True))
    num_blocks = max(g.blocks for family in gears.values() for g in family) + 1  # nominal; bound at load
    local = rank_config(model, size)  # the KV heads of this rank's pools
    pool_shape = ((num_blocks * block_size, local.kv_size) if target == "cpu"
                  else (num_blocks, block_size, local.num_kv_heads, model.head_dim))
    tasks = [(cache, family, gear) for cache in caches for family, family_gears in gears.items()
             for gear in family_gears]
    workers = max(1, min(workers or default_workers(), len(tasks)))
    done: dict[tuple[str, str, str], _Compiled] = {}
    with tempfile.TemporaryDirectory(prefix="pagedgraph-mindir-") as scratch, \
            stage_bar(log, len(tasks), f"mindir {target}, {workers} worker{'s' if workers > 1 else ''}", "gear",
                      unit_scale=False) as bar:
        job = _Job(model, forms, block_size, target, dtype, str(out), scratch, entries, pool_shape, directory, size)
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
                _WORKER.clear()  # the cells
                ms.set_context(jit_config=previous or {"infer_boost": "off"})
        else:
            # spawn, not fork: MindSpore's runtime threads do not survive a fork
            context = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(workers, context, _start_worker, (job,)) as pool:
                for future in as_completed([pool.submit(_compile, *task) for task in tasks]):
                    result = future.result()
                    done[result.kv_cache_dtype, result.family, result.key] = result
                    bar.update()
    weight_inputs = {}
    for cache in caches:  # every family of a cache dtype takes the same weights in the same order
        (order,) = {r.weights for r in done.values() if r.kv_cache_dtype == cache}
        weight_inputs[cache] = order
    (inputs,) = {r.inputs for r in done.values()}
    graphs = {cache: {family: {gear_key(g): done[cache, family, gear_key(g)].rel for g in family_gears}
                      for family, family_gears in gears.items()} for cache in caches}
    index = MindirIndex(target=target, dtype=dtype, inputs=inputs, weights=entries, pool_shape=pool_shape,
                        graphs=graphs.pop(dtype), kv_cache_graphs=graphs, weight_inputs=weight_inputs)
    (out / index_file).write_text(index.to_json())
    return index


def _target_arrays(weights: Mapping[str, Weight], target: str, dtype: str,
                   w8a8_inputs: dict[str, tuple[float, int]], int4: set[str], bar: Any) -> Iterator[tuple[str, np.ndarray]]:
    """The graph's parameters in the compute dtype, one weight at a time (each is converted, yielded to the
    writer and dropped); a block-quantized weight (Ascend w8a16) as the parts its Ascend bodies take
    (ascend_ops.ascend_block_arrays), an int8 one (Ascend w8a8) as MindIE's W8A8 tensors, under graphs/quant.py's
    names; on Ascend a stack of experts in GroupedMatmulV4's layout [E, K, N] (ascend_moe). The names of int4 codes
    (packed, qint4x2) are added to `int4`; `bar` counts the weights done."""
    for name, w in weights.items():
        yield from _target_parts(name, w, target, dtype, w8a8_inputs, int4)
        bar.update()


def _target_parts(name: str, w: Weight, target: str, dtype: str, w8a8_inputs: dict[str, tuple[float, int]],
                  int4: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    if target == "ascend" and (isinstance(w, ExpertStack) or np.ndim(w) == 3):
        yield from _ascend_experts(name, w, dtype, int4)
        return
    if isinstance(w, Int8PerChannel):
        from .ascend_ops import w8a8_static_arrays

        yield from zip(w8a8_static_parts(name), w8a8_static_arrays(w, *w8a8_inputs[name], dtype))
        return
    if not isinstance(w, BlockQuantized):
        yield name, np.asarray(w).astype(numpy_dtype(dtype), copy=False)
        return
    from .ascend_ops import ascend_block_arrays

    gathered = name == "embed"
    if gathered and (w.bits != 8 or w.minimum is not None):
        raise ValueError(f"the {w.bits}-bit embedding ({w.source}): the Ascend gather reads int8 rows without a "
                         "minimum only")
    names, arrays = graph_parts(name, w, gathered), graph_arrays(name, w, gathered)
    parts = ascend_block_arrays(*(None if n is None else arrays[n] for n in names), w.bits, w.block_size, dtype)
    if w.bits == 4:
        int4.add(names[0])
    yield from ((n, part) for n, part in zip(names, parts) if n is not None and part is not None)


def _ascend_experts(name: str, w: Weight, dtype: str, int4: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    """A stack of experts [E, N, K] as the Ascend GroupedMatmul bodies read it (exporter/mindspore/ascend_moe.py):
    float experts [E, K, N] in the compute dtype, quantized ones as GroupedMatmulV4's antiquant parts."""
    from .ascend_moe import ascend_expert_arrays, ascend_expert_block_arrays

    if not isinstance(w, ExpertStack):
        yield name, ascend_expert_arrays(np.asarray(w), numpy_dtype(dtype))
        return
    form = w.form
    names, arrays = graph_parts(name, form), stacked_graph_arrays(name, w)
    parts = ascend_expert_block_arrays(*(None if n is None else arrays[n] for n in names), form.bits,
                                       form.block_size, numpy_dtype(dtype))
    if form.bits == 4:
        int4.add(names[0])  # type: ignore[arg-type]
    yield from ((n, part) for n, part in zip(names, parts) if n is not None and part is not None)


def default_workers() -> int:
    """Compile processes: one per core, as many as fit in the available memory, each holding a compile's
    working set, COMPILE_BYTES (measured in docs/performance.md); no worker holds weights."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, _available_memory() // COMPILE_BYTES))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _start_worker(job: _Job) -> None:
    """Process initializer: mindspore, in GRAPH_MODE on the host.

    Ascend compiles with MindSpore's infer_boost on, as MindFormers serves: its PagedAttention takes an int8
    cache only then."""
    ms = import_mindspore("--format mindir")
    if job.target == "ascend":
        ms.set_context(jit_config={"infer_boost": "on"})
    _WORKER.clear()
    _WORKER.update(job=job, ms=ms, cells={})


def _compile(kv_cache_dtype: str, family: str, gear: Gear) -> _Compiled:
    """Export one gear's MINDIR for pools of `kv_cache_dtype` (in a worker, or in-process with one worker)."""
    job, ms, cells = _WORKER["job"], _WORKER["ms"], _WORKER["cells"]
    if (family, kv_cache_dtype) not in cells:
        scratch = Path(job.scratch) / str(os.getpid())
        scratch.mkdir(exist_ok=True)
        cells[family, kv_cache_dtype] = _bucket_cell(job, family, kv_cache_dtype, scratch)
    cell, builder = cells[family, kv_cache_dtype]
    rel = kv_variant(f"{job.directory}/{family}_{gear_key(gear)}.mindir", kv_cache_dtype, job.dtype)
    path = Path(job.out) / rel
    ms.export(cell, *_example_args(ms, job, gear, builder, kv_cache_dtype), file_name=str(path),
              file_format="MINDIR")
    os.chmod(path, 0o644)  # MindSpore leaves its files owner-read-only
    return _Compiled(kv_cache_dtype, family, gear_key(gear), rel, tuple(builder.inputs), tuple(builder.weights))


def _bucket_cell(job: _Job, family: str, kv_cache_dtype: str, scratch: Path) -> tuple[Any, MindSporeBuilder]:
    """Record the model's build against the target's lowering and instantiate the generated Cell."""
    if job.target == "cpu":
        from .cpu_ops import MINDSPORE_CPU
        from ...cpu_kernels.build import library_path

        lowering, ms_target = MINDSPORE_CPU, MindSporeTarget("cpu", library=library_path(), dtype=job.dtype)
    else:
        from .ascend_ops import MINDSPORE_ASCEND, Float32Logits

        lowering, ms_target = MINDSPORE_ASCEND, MindSporeTarget("ascend", multi_query=family != DECODE,
                                                                logits=Float32Logits, dtype=job.dtype)
    builder = MindSporeBuilder(lowering, ms_target)
    models.build(builder, job.model, GraphOptions(job.block_size, job.forms, kv_cache_dtype,
                                                  tensor_parallel_size=job.tensor_parallel_size))
    cell = load_cell_class(builder.source(), scratch / f"{job.target}_{family}_{kv_cache_dtype}.py")(builder.cells)
    return cell, builder


def _example_args(ms: Any, job: _Job, gear: Gear, builder: MindSporeBuilder, kv_cache_dtype: str) -> list[Any]:
    """The graph's arguments as tensors of the gear's shapes and dtypes, in call order: contract inputs, pools,
    weights. An export only infers shapes and never runs the graph, so they hold no data (MindSpore's lazy
    `init`): exporting a gear costs no memory for the pools or the weights, however large."""
    from mindspore import dtype as mstype
    from mindspore.common.initializer import Zero

    def placeholder(shape: tuple[int, ...], dtype: str) -> Any:
        return ms.Tensor(shape=shape, dtype=getattr(mstype, dtype), init=Zero())

    shapes = gear.input_shapes()
    return ([placeholder(shapes[n], np.dtype(c.INPUT_DTYPES[n]).name) if n in shapes
             else placeholder(job.pool_shape, kv_cache_dtype) for n in builder.inputs]
            + [placeholder(job.entries[w].shape, job.entries[w].dtype or job.dtype) for w in builder.weights])
