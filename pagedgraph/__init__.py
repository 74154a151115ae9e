"""pagedgraph: export LLaMA-family checkpoints to bucketed static graphs and serve them with a paged runtime.

The public Python API is `from pagedgraph import LLM, SamplingParams`. It is imported on first use, so
`import pagedgraph` (the console script, `--version`) stays light and nothing here imports in a circle.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"LLM": "runtime.engine", "LLMEngine": "runtime.engine", "RequestOutput": "runtime.engine",
         "SamplingParams": "runtime.sampling_params"}
__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedgraph' has no attribute {name!r}")
