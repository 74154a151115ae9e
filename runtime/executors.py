"""Executor choice: every executor runs a gear's graph with the same interface (run, copy_blocks, pools)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from artifact.manifest import Manifest

EXECUTORS = ("onnxruntime", "mindspore")
# Whether the ONNX Runtime executor runs the fused ops as pagedgraph's C++ custom ops (runtime/executor_ort.py).
CustomOps = Literal["auto", "on", "off"]
CUSTOM_OPS: tuple[CustomOps, ...] = get_args(CustomOps)


def check_custom_ops(mode: str) -> None:
    """One error for every place the setting enters (EngineConfig, the executor), naming the allowed values."""
    if mode not in CUSTOM_OPS:
        raise ValueError(f"custom_ops = {mode!r}: choose one of {', '.join(CUSTOM_OPS)}")


def make_executor(name: str, artifact: Path, manifest: Manifest, num_blocks: int, threads: int | None,
                  custom_ops: CustomOps) -> Any:
    """Imported lazily: MindSpore is an optional extra and takes seconds to import.

    MindSpore ignores `custom_ops`: its MINDIR graphs call pagedgraph's kernels themselves.
    """
    if name == "onnxruntime":
        from runtime.executor_ort import OrtExecutor

        return OrtExecutor(artifact, manifest, num_blocks, threads, custom_ops)
    if name == "mindspore":
        from runtime.executor_mindspore import MindSporeExecutor

        return MindSporeExecutor(artifact, manifest, num_blocks, threads)
    raise ValueError(f"executor = {name!r}: choose one of {', '.join(EXECUTORS)}")
