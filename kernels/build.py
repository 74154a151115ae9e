"""Compile the kernel sources next to this file into shared libraries, once per source version.

Two libraries: the kernels (ctypes, MindSpore AOT) and the ONNX Runtime custom-op library (the
same kernels behind ORT's C API, built against a header from ort_headers). Each lands in a
per-user cache directory keyed by a hash of its sources, headers and flags, so the exporter and
the runtime on one machine share it and an edited source or another ORT header rebuilds it. The
build writes to a temporary name and renames it, so concurrent first uses never load half a file.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from .cache import cache_root
from .ort_headers import HEADER, include_dir

HERE = Path(__file__).parent
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17")
LIBRARY = "libpagedgraph_kernels.so"
ORT_LIBRARY = "libpagedgraph_ort.so"
# Each library's own entry points; every other .cc next to this file is a kernel source both link.
ENTRY_POINTS = {LIBRARY: "mindspore_aot.cc", ORT_LIBRARY: "ort_ops.cc"}
# Only RegisterCustomOps is exported: ORT loads the library beside the kernels library, whose
# pg_* symbols must not bind to this copy's (or the reverse).
ORT_FLAGS = ("-fvisibility=hidden",)


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled; the message says what to install or set."""


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "g++", "c++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise KernelBuildError("no C++ compiler found (looked for $CXX, g++, c++); the MindSpore CPU target and the "
                           "ONNX Runtime custom ops run pagedgraph's own C++ kernels: install one (e.g. "
                           "`apt-get install g++`) or set CXX")


def _cpu_flags() -> bytes:
    """-march=native code is only valid on CPUs with the same features: they are part of the key."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_bytes().splitlines() if line.startswith(b"flags")), b"")
    except OSError:
        return b""


def _fingerprint(command: list[str], inputs: list[Path]) -> str:
    digest = hashlib.sha256(" ".join(command).encode() + _cpu_flags())
    for path in inputs:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _build(name: str, flags: tuple[str, ...] = (), include: Path | None = None) -> Path:
    """The library `name` (its entry point plus the kernel sources), compiled on first use.

    The cache key covers the compiler, flags, CPU features and the content of every source and
    header here, and of `include`'s onnxruntime_c_api.h: its path is a machine detail, its version is not.
    """
    kernels = sorted(p.name for p in HERE.glob("*.cc") if p.name not in ENTRY_POINTS.values())
    sources = [ENTRY_POINTS[name], *kernels]
    inputs = [HERE / s for s in sources] + sorted(HERE.glob("*.h"))
    if include:
        inputs.append(include / HEADER)
    compiler = _compiler()
    target = cache_root() / "kernels" / _fingerprint([compiler, *FLAGS, *flags, *sources], inputs) / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=name, dir=target.parent)
    os.close(fd)
    includes = ["-I", str(HERE)] + (["-I", str(include)] if include else [])
    command = [compiler, *FLAGS, *flags, *includes, *(str(HERE / s) for s in sources), "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        os.unlink(partial)
        raise KernelBuildError(f"compiling {name} failed ({' '.join(command)}):\n{result.stderr}")
    os.replace(partial, target)
    return target


def library_path() -> Path:
    """The kernels library (C API of kernels.h, MindSpore AOT entry points)."""
    return _build(LIBRARY)


def ort_library_path() -> Path:
    """The ONNX Runtime custom-op library; raises ort_headers.OrtHeaderError when no header is found."""
    return _build(ORT_LIBRARY, ORT_FLAGS, include_dir(cache_root()))
