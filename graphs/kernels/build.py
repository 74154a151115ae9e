"""Compile the kernel sources next to this file into one shared library, once per source version.

The library lands in a per-user cache directory keyed by a hash of the sources and flags, so
the exporter and the runtime on one machine share it and an edited source rebuilds it. The
build writes to a temporary name and renames it, so concurrent first uses never load half a file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = ("attention.cc", "mindspore_aot.cc")
HEADERS = ("kernels.h",)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
LIBRARY = "libpagedgraph_kernels.so"
CACHE_ENV = "PAGEDGRAPH_CACHE_DIR"


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled; the message says what to install or set."""


def cache_root() -> Path:
    """$PAGEDGRAPH_CACHE_DIR, else $XDG_CACHE_HOME/pagedgraph, else ~/.cache/pagedgraph."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedgraph"


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise KernelBuildError("no C++ compiler found (looked for $CXX, g++, c++); the MindSpore CPU target runs "
                           "pagedgraph's own C++ kernels: install one (e.g. `apt-get install g++`) or set CXX")


def _cpu_flags() -> bytes:
    """-march=native code is only valid on CPUs with the same features: they are part of the key."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_bytes().splitlines() if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _fingerprint(compiler: str) -> str:
    here = Path(__file__).parent
    digest = hashlib.sha256(" ".join((compiler, *FLAGS)).encode() + _cpu_flags())
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()[:16]


def library_path() -> Path:
    """The compiled library, building it on first use."""
    compiler = _compiler()
    target = cache_root() / "kernels" / _fingerprint(compiler) / LIBRARY
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    here = Path(__file__).parent
    fd, partial = tempfile.mkstemp(prefix=LIBRARY, dir=target.parent)
    os.close(fd)
    command = [compiler, *FLAGS, "-I", str(here), *(str(here / s) for s in SOURCES), "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        os.unlink(partial)
        raise KernelBuildError(f"compiling the pagedgraph kernels failed ({' '.join(command)}):\n{result.stderr}")
    os.replace(partial, target)
    return target
