"""The per-user cache directory the kernel libraries and the fetched ORT header live in."""
from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PAGEDGRAPH_CACHE_DIR"


def cache_root() -> Path:
    """$PAGEDGRAPH_CACHE_DIR, else $XDG_CACHE_HOME/pagedgraph, else ~/.cache/pagedgraph."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedgraph"
