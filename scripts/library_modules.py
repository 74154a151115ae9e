"""Modules of a library imported without running its packages' `__init__`.

auto-gptq and autoawq are installed without their dependencies (scripts/test.sh): their package `__init__`s import
GPU-era transformers APIs, while the packing and dequantization modules the GPTQ/AWQ tests and
scripts/gptq_checkpoint.py use need torch alone.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path


class LibraryMissing(ModuleNotFoundError):
    """The library is not installed at all (as opposed to one of its own imports failing)."""


def bare_module(module: str) -> types.ModuleType:
    """`module` of an installed library, its parent packages made bare (their `__init__` not run)."""
    parts = module.split(".")
    if parts[0] not in sys.modules:
        spec = importlib.util.find_spec(parts[0])
        if spec is None or not spec.submodule_search_locations:
            raise LibraryMissing(f"{parts[0]} is not installed (scripts/test.sh installs it with --no-deps)")
        package = types.ModuleType(parts[0])
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[parts[0]] = package
    root = Path(sys.modules[parts[0]].__path__[0])
    for depth in range(1, len(parts)):
        name = ".".join(parts[:depth])
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(root.joinpath(*parts[1:depth]))]
            sys.modules[name] = package
    return importlib.import_module(module)
