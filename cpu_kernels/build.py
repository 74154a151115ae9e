"""Compile the kernel sources next to this file into shared libraries, once per source version.

Two libraries: the kernels (ctypes, MindSpore AOT) and the ONNX Runtime custom-op library (the
same kernels behind ORT's C API, built against a header from ort_headers). Where oneDNN's headers are
installed (Debian's libdnnl-dev), the custom-op library also gets Linear.bf16 (onednn_linear.cc), linked
to the system's libdnnl; without them it is built without that op (`onednn_missing` says why). Each lands in a
per-user cache directory keyed by a hash of its sources, headers and flags, so the exporter and
the runtime on one machine share it and an edited source or another ORT header rebuilds it. The
build holds a lock beside its target, so concurrent first uses (test workers, a fleet's replicas) compile once,
and writes to a temporary name and renames it, so no reader ever loads half a file.
"""
from __future__ import annotations

import fcntl
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
# Only RegisterCustomOps (and PgBf16LinearSupported, PgBf16LinearImplementations) is exported: ORT loads the
# library beside the kernels library, whose pg_* symbols must not bind to this copy's (or the reverse).
ORT_FLAGS = ("-fvisibility=hidden",)
# Compiled into the custom-op library only, and only with oneDNN: the kernels library must not need libdnnl.
ONEDNN_SOURCES = ("onednn_linear.cc",)
ONEDNN_HEADER = "oneapi/dnnl/dnnl.hpp"
ONEDNN_FLAGS = ("-DPG_WITH_ONEDNN",)
ONEDNN_LINK = ("-ldnnl",)
# The compiler's default include directories, where `apt-get install libdnnl-dev` puts the headers.
_SYSTEM_INCLUDES = (Path("/usr/include"), Path("/usr/local/include"))


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


def onednn_include() -> Path | None:
    """The include directory holding oneDNN's C++ header, or None."""
    return next((d for d in _SYSTEM_INCLUDES if (d / ONEDNN_HEADER).is_file()), None)


def onednn_missing() -> str | None:
    """Why the custom-op library has no oneDNN Linear.bf16 here (None: it has)."""
    if onednn_include() is None:
        return (f"oneDNN's headers ({ONEDNN_HEADER}) are not installed: `apt-get install libdnnl-dev` "
                "(Debian's oneDNN, which pagedgraph's bfloat16 GEMM calls)")
    return None


def _build(name: str, flags: tuple[str, ...] = (), include: Path | None = None,
           extra: tuple[str, ...] = (), link: tuple[str, ...] = (), headers: tuple[Path, ...] = (),
           source: Path = HERE) -> Path:
    """The library `name` (its entry point, the kernel sources and `extra` sources in `source`), compiled on first use.

    The cache key covers the compiler, flags, CPU features and the content of every source and
    header here, of `include`'s onnxruntime_c_api.h and of `headers` (a library's version header): their
    paths are machine details, their versions are not.
    """
    kernels = sorted(p.name for p in source.glob("*.cc") if p.name not in (*ENTRY_POINTS.values(), *ONEDNN_SOURCES))
    sources = [ENTRY_POINTS[name], *kernels, *extra]
    inputs = [source / s for s in sources] + sorted(source.glob("*.h")) + list(headers)
    if include:
        inputs.append(include / HEADER)
    compiler = _compiler()
    target = cache_root() / "kernels" / _fingerprint([compiler, *FLAGS, *flags, *sources, *link], inputs) / name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when closed; a process that dies lets go of it too
        if not target.is_file():  # built by whoever held the lock before
            _compile(name, [compiler, *FLAGS, *flags], include, source, sources, link, target)
    return target


def _compile(name: str, command: list[str], include: Path | None, source: Path, sources: list[str],
             link: tuple[str, ...], target: Path) -> None:
    fd, partial = tempfile.mkstemp(prefix=name, dir=target.parent)
    os.close(fd)
    includes = ["-I", str(source)] + (["-I", str(include)] if include else [])
    command = [*command, *includes, *(str(source / s) for s in sources), *link, "-o", partial]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        os.unlink(partial)
        raise KernelBuildError(f"compiling {name} failed ({' '.join(command)}):\n{result.stderr}")
    os.replace(partial, target)


def library_path(source: Path = HERE) -> Path:
    """The kernels library (C API of kernels.h, MindSpore AOT entry points) of the sources in `source` (by default
    these; another revision's for a benchmark's baseline)."""
    return _build(LIBRARY, source=source)


def ort_library_path() -> Path:
    """The ONNX Runtime custom-op library; raises ort_headers.OrtHeaderError when no header is found."""
    onednn = onednn_include()
    if onednn is None:
        return _build(ORT_LIBRARY, ORT_FLAGS, include_dir(cache_root()))
    return _build(ORT_LIBRARY, ORT_FLAGS + ONEDNN_FLAGS, include_dir(cache_root()), extra=ONEDNN_SOURCES,
                  link=ONEDNN_LINK, headers=(onednn / "oneapi/dnnl/dnnl_version.h",))
