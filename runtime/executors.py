"""The executor interface, and the choice of one: every executor runs a gear's graph over the same KV pools."""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Protocol, get_args

import numpy as np

from ..artifact.manifest import Manifest
from ..graphs.contract import Gear
from .executor_ort import CUSTOM_OPS, CustomOps, OrtExecutor, check_custom_ops
from .kv_pools import KVPools

ExecutorName = Literal["onnxruntime", "mindspore"]
EXECUTORS: tuple[str, ...] = get_args(ExecutorName)


class Executor(Protocol):
    """Runs the bucket graphs; the graphs read and write `pools` in place (outputs alias inputs)."""

    pools: KVPools
    # Whether the fused ops run as pagedgraph's C++ custom ops; None where that is not a choice (MindSpore).
    custom_ops: bool | None

    def run(self, gear: Gear, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """One step's logits [gear.seqs, vocab], valid until the next run (an executor may reuse the buffer);
        `inputs` are the packer's buffers for `gear`, the same arrays every step (executors bind them once, by
        identity)."""
        ...


def make_executor(name: str, artifact: Path, manifest: Manifest, pools: KVPools, threads: int | None,
                  custom_ops: CustomOps) -> Executor:
    """MindSpore is imported lazily: it is an optional extra and takes seconds to import.

    MindSpore ignores `custom_ops`: its MINDIR graphs call pagedgraph's kernels themselves. A tensor-parallel
    artifact runs its rank graphs in one process (runtime/tp_executor.py, the AllReduce simulated).
    """
    if name == "onnxruntime" and manifest.tensor_parallel_size > 1:
        from .tp_executor import TensorParallelExecutor

        return TensorParallelExecutor(artifact, manifest, pools, threads, custom_ops)
    if name == "onnxruntime":
        return OrtExecutor(artifact, manifest, pools, threads, custom_ops)
    if name == "mindspore":
        from .executor_mindspore import MindSporeExecutor

        if manifest.tensor_parallel_size > 1:
            raise ValueError(f"executor mindspore: {artifact} is split over {manifest.tensor_parallel_size} ranks; "
                             "the CPU MINDIR is single-device (Ascend rank graphs run under msrun, "
                             "docs/scale-out.md); use executor onnxruntime (the single-process simulation)")
        if pools.kv_cache_dtype != "float32":
            raise ValueError(f"kv_cache_dtype = {pools.kv_cache_dtype!r}: the MINDIR graphs hold a float32 KV cache; "
                             f"use executor onnxruntime for a {pools.kv_cache_dtype} cache, or kv_cache_dtype auto")

        return MindSporeExecutor(artifact, manifest, pools, threads)
    raise ValueError(f"executor = {name!r}: choose one of {', '.join(EXECUTORS)}")


__all__ = ["CUSTOM_OPS", "EXECUTORS", "CustomOps", "Executor", "ExecutorName", "check_custom_ops", "make_executor"]
