"""Executor choice: every executor runs a gear's graph with the same interface (run, copy_blocks, pools)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from graphs.manifest import Manifest

EXECUTORS = ("onnxruntime", "mindspore")


def make_executor(name: str, artifact: Path, manifest: Manifest, num_blocks: int, threads: int | None) -> Any:
    """Imported lazily: MindSpore is an optional extra and takes seconds to import."""
    if name == "onnxruntime":
        from runtime.executor_ort import OrtExecutor

        return OrtExecutor(artifact, manifest, num_blocks, threads)
    if name == "mindspore":
        from runtime.executor_mindspore import MindSporeExecutor

        return MindSporeExecutor(artifact, manifest, num_blocks, threads)
    raise ValueError(f"executor = {name!r}: choose one of {', '.join(EXECUTORS)}")
