"""Modules of a library imported without running its top-level package's `__init__`.

auto-gptq and autoawq are installed without their dependencies (scripts/test.sh): their top-level `__init__`s import
GPU-era transformers APIs (autoawq's: every model class it has), while the packing and dequantization modules the
GPTQ/AWQ tests and scripts/gptq_checkpoint.py use need torch alone. AutoAWQ's quantizer (scripts/awq_checkpoint.py
and its test) also imports `datasets` at the top of a module, for its hub-dataset path only: `not_installed` lets
that import pass (installing datasets would pull pyarrow, pandas 3 and numpy 2, which mindspore 2.10 does not take).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager


class LibraryMissing(ModuleNotFoundError):
    """The library is not installed at all (as opposed to one of its own imports failing)."""


def bare_module(module: str) -> types.ModuleType:
    """`module` of an installed library, its top-level package made bare (its `__init__` not run); the
    subpackages import as usual (AutoAWQ's model classes need `awq.modules.linear`'s `__init__`)."""
    top = module.split(".")[0]
    if top not in sys.modules:
        spec = importlib.util.find_spec(top)
        if spec is None or not spec.submodule_search_locations:
            raise LibraryMissing(f"{top} is not installed (scripts/test.sh installs it with --no-deps)")
        package = types.ModuleType(top)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[top] = package
    return importlib.import_module(module)


@contextmanager
def not_installed(name: str, why: str) -> Iterator[None]:
    """While a library's modules import, a top-level `from name import f` of an absent package `name` succeeds;
    calling `f` raises, saying `why` the path needing it is not taken. Gone again afterwards, so nothing else
    sees `name` as installed."""
    if importlib.util.find_spec(name) is not None:
        yield
        return

    def missing(attr: str) -> object:
        if attr.startswith("__"):  # what inspect and importlib probe every module for (__file__, __path__, ...)
            raise AttributeError(attr)

        def call(*args: object, **kwargs: object) -> None:
            raise LibraryMissing(f"{name}.{attr}: {name} is not installed ({why})")
        return call

    module = types.ModuleType(name)
    module.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = module
    try:
        yield
    finally:
        del sys.modules[name]


def autoawq(module: str) -> types.ModuleType:
    """A module of autoawq (its model classes, its quantizer), its top-level package bare and `datasets` not needed:
    the calibration windows are passed as token lists."""
    with not_installed("datasets", "AutoAWQ loads a hub calibration set with it; pass the windows as tokens"):
        return bare_module(module)
