"""ONNX Runtime's C API header for the custom-op library, found on this machine or fetched at install time.

The onnxruntime wheel ships no headers and none may be committed here, so `python -m
pagedgraph.cpu_kernels.ort_headers` takes the one header ort_ops.cc needs from Debian's
libonnxruntime-dev package (stdlib only: index, SHA256-checked .deb, ar and tar parsed here).
Only onnxruntime_c_api.h is used: the C API is versioned, so a header of an older ORT_API_VERSION
builds a library that a newer onnxruntime still loads.
"""
from __future__ import annotations

import hashlib
import io
import lzma
import os
import platform
import re
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from .cache import cache_root

HEADER = "onnxruntime_c_api.h"
INCLUDE_ENV = "PAGEDGRAPH_ORT_INCLUDE"
SYSTEM_INCLUDE = Path("/usr/include/onnxruntime")
MIRROR = "http://deb.debian.org/debian"
SUITE = "trixie"  # the first Debian release with libonnxruntime-dev
PACKAGE = "libonnxruntime-dev"
MEMBER = "usr/include/onnxruntime/" + HEADER
FETCH_COMMAND = "python -m pagedgraph.cpu_kernels.ort_headers"
_DPKG_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "ppc64le": "ppc64el",
              "s390x": "s390x", "riscv64": "riscv64", "i686": "i386", "i386": "i386"}
_TIMEOUT_S = 60


class OrtHeaderError(RuntimeError):
    """No onnxruntime_c_api.h to build the custom-op library with; the message says how to get one."""


def _otherwise() -> str:
    return (f"set {INCLUDE_ENV} to a directory holding {HEADER}, or `apt-get install {PACKAGE}` on Debian "
            "trixie or later")


def _how_to_fix() -> str:
    return f"run `{FETCH_COMMAND}` (downloads it from Debian's {PACKAGE}), or {_otherwise()}"


def _cache(root: Path) -> Path:
    return root / "ort-include"


def api_version(include: Path) -> int:
    """The header's ORT_API_VERSION: the newest C API the library may call."""
    found = re.search(rb"#define\s+ORT_API_VERSION\s+(\d+)", (include / HEADER).read_bytes())
    if not found:
        raise OrtHeaderError(f"{include / HEADER} defines no ORT_API_VERSION; {_how_to_fix()}")
    return int(found[1])


def include_dir(root: Path) -> Path:
    """The directory holding onnxruntime_c_api.h: $PAGEDGRAPH_ORT_INCLUDE, the system's, else the fetched one."""
    if os.environ.get(INCLUDE_ENV):
        chosen = Path(os.environ[INCLUDE_ENV])
        if not (chosen / HEADER).is_file():
            raise OrtHeaderError(f"{INCLUDE_ENV}={chosen} holds no {HEADER}; {_how_to_fix()}")
        return chosen
    if (SYSTEM_INCLUDE / HEADER).is_file():
        return SYSTEM_INCLUDE
    fetched = [d for d in _cache(root).glob("[!.]*") if (d / HEADER).is_file()]  # not .partial-* dirs
    if not fetched:
        raise OrtHeaderError(f"ONNX Runtime's C API header {HEADER} was not found; {_how_to_fix()}")
    return max(fetched, key=api_version)


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            return response.read()
    except OSError as error:
        raise OrtHeaderError(f"downloading {url} failed ({error}); {_otherwise()}") from error


def _package_entry(arch: str) -> dict[str, str]:
    """The index stanza of PACKAGE (Filename, SHA256, Version, ...), read as the index streams in."""
    url = f"{MIRROR}/dists/{SUITE}/main/binary-{arch}/Packages.xz"
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response, lzma.open(response, "rt") as index:
            fields: dict[str, str] = {}
            for line in index:
                if line == "\n":
                    if fields.get("Package") == PACKAGE:
                        return fields
                    fields = {}
                elif not line[0].isspace() and ":" in line:
                    key, value = line.split(":", 1)
                    fields[key] = value.strip()
            if fields.get("Package") == PACKAGE:
                return fields
    except (OSError, lzma.LZMAError, EOFError) as error:
        raise OrtHeaderError(f"reading the Debian index {url} failed ({error}); {_otherwise()}") from error
    raise OrtHeaderError(f"{PACKAGE} is not in {url}; {_otherwise()}")


def _ar_members(archive: bytes) -> dict[str, bytes]:
    """The members of an `ar` archive (a .deb): 60-byte headers, data padded to an even length."""
    if not archive.startswith(b"!<arch>\n"):
        raise OrtHeaderError("the downloaded package is not an ar archive")
    members, at = {}, 8
    while at + 60 <= len(archive):
        header = archive[at:at + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        members[name] = archive[at + 60:at + 60 + size]
        at += 60 + size + size % 2
    return members


def _header_from_deb(deb: bytes) -> bytes:
    data = [v for k, v in _ar_members(deb).items() if k.startswith("data.tar")]
    if not data:
        raise OrtHeaderError("the package holds no data.tar member")
    try:
        with tarfile.open(fileobj=io.BytesIO(data[0]), mode="r:*") as tar:  # gz, bz2, xz or plain
            for info in tar:
                if info.isfile() and info.name.removeprefix("./") == MEMBER:
                    return tar.extractfile(info).read()
    except tarfile.TarError as error:
        raise OrtHeaderError(f"unpacking the package's data archive failed ({error})") from error
    raise OrtHeaderError(f"the package holds no {MEMBER}")


def fetch(root: Path) -> Path:
    """Download PACKAGE for this machine, check its SHA256, and extract HEADER into the cache; its directory."""
    arch = _DPKG_ARCH.get(platform.machine().lower())
    if arch is None:
        raise OrtHeaderError(f"no Debian architecture known for {platform.machine()}; {_otherwise()}")
    entry = _package_entry(arch)
    target = _cache(root) / entry["Version"]
    if (target / HEADER).is_file():
        return target
    deb = _get(f"{MIRROR}/{entry['Filename']}")
    if hashlib.sha256(deb).hexdigest() != entry["SHA256"]:
        raise OrtHeaderError(f"{entry['Filename']} does not match the SHA256 of the Debian index; not using it")
    header = _header_from_deb(deb)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=".partial-", dir=target.parent))
    (partial / HEADER).write_bytes(header)
    try:
        partial.rename(target)
    except OSError:  # a concurrent fetch won: its copy is the same file
        (partial / HEADER).unlink()
        partial.rmdir()
    return target


def ensure(root: Path) -> Path:
    """The header's directory on this machine, fetching it first when there is none."""
    try:
        return include_dir(root)
    except OrtHeaderError:
        if os.environ.get(INCLUDE_ENV):  # the build would still use that directory: fetching cannot help
            raise
        return fetch(root)


def main() -> None:
    """Print the header in use, fetching it first when this machine has none (install scripts run this)."""
    try:
        found = ensure(cache_root())
    except OrtHeaderError as error:
        sys.exit(f"no ONNX Runtime C API header for the custom-op library: {error}")
    print(found / HEADER)


if __name__ == "__main__":
    main()
