"""pagedgraph: export LLaMA-family checkpoints to bucketed static graphs and serve them with a paged runtime.

The public Python API is `from pagedgraph import LLM, SamplingParams` (`PoolingParams` for an embedding artifact's
`LLM.embed`). It is imported on first use, so
`import pagedgraph` (the console script, `--version`) stays light and nothing here imports in a circle.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

# Installed (a wheel), pagedgraph.runtime etc. lie inside this folder (setup.cfg package_dir). In a source
# checkout they are the repository's top-level folders: search there too, so `python -m pagedgraph.cli` run
# from a checkout imports that checkout's code, whatever else is installed.
_CHECKOUT = Path(__file__).resolve().parent.parent
if (_CHECKOUT / "setup.cfg").is_file() and not (Path(__file__).parent / "runtime").exists():
    __path__.append(str(_CHECKOUT))

__version__ = "0.1.0"

_LAZY = {"LLM": "pagedgraph.runtime.engine", "LLMEngine": "pagedgraph.runtime.engine",
         "RequestOutput": "pagedgraph.runtime.engine", "SamplingParams": "pagedgraph.runtime.sampling_params",
         "PoolingParams": "pagedgraph.runtime.pooling_params"}
__all__ = ["LLM", "LLMEngine", "PoolingParams", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedgraph' has no attribute {name!r}")
