"""Shared pieces of the MindSpore tests: skip without MindSpore, export small artifacts, record logits."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export


def require_mindspore() -> None:
    """Skip the calling module where MindSpore is not installed (CI installs `.[mindspore]`)."""
    pytest.importorskip("mindspore", reason="MindSpore is not installed: pip install -e .[mindspore]")


def export_artifact(source: str, out: Path, formats: list[str], decode: list[int], prefill: list[int],
                    max_seqs: int, max_model_len: int, target: str = "cpu", model: dict[str, Any] | None = None,
                    mindir_workers: int | None = 1, **options: Any) -> Path:
    """A small export; `model` adds model keys (dtype, ...), `options` export keys (kv_cache_dtypes, ...).

    MINDIR gears compile in this process unless `mindir_workers` says otherwise (None: the export's default, one
    worker per core): a spawned worker imports MindSpore again, seconds, where a tiny model's gear compiles in a
    fraction of one. tests/exporter/test_mindir_parallel.py checks the workers."""
    config = ExportConfig.model_validate({
        "model": {"source": source, **(model or {})},
        "export": {"formats": formats, "target": target, "max_model_len": max_model_len, "verify_gears": False,
                   "buckets": {"decode_batch": decode, "prefill_tokens": prefill, "prefill_max_seqs": max_seqs},
                   "mindir_workers": mindir_workers, **options},
    })
    export(config, out, log=io.StringIO())
    return out


class RecordingExecutor:
    """Wraps an executor and keeps a copy of every step's gear and logits, to compare two engines step by step."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.steps: list[tuple[Any, np.ndarray]] = []

    def run(self, gear: Any, inputs: dict[str, np.ndarray]) -> np.ndarray:
        logits = self.inner.run(gear, inputs)
        self.steps.append((gear, logits.copy()))
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)
