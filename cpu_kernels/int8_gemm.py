"""Exact int8 GEMM on every x86 CPU: ONNX Runtime's u8s8 kernel saturates where the CPU has no VNNI.

Linear.w8a8's ONNX body (exporter/onnx/quantized.py) feeds `MatMulIntegerToFloat` uint8 activations (the codes
+ 128) and int8 weights: MLAS's u8s8 GEMM. With VNNI (`vpdpbusd`: AVX-512 VNNI or AVX-VNNI) it sums every product
exactly in int32. Without it (AVX2, or AVX-512 without VNNI) MLAS adds pairs of u8 x s8 products in int16 with
saturation (`vpmaddubsw`): a code of 200 against a weight of 100 in two neighbouring columns already exceeds
32,767, and the output is off by up to a fifth of its range (docs/performance.md, "Which kernel runs"). ONNX
Runtime's documented remedy is the u8u8 form, which MLAS widens to 16 bits before multiplying, exactly and, on
AVX2, about as fast. So where the CPU lacks VNNI, `exact_int8_gemm` rewrites a loaded graph to u8u8: each int8
weight, shifted by 128, gets the zero point 128. One artifact serves every CPU; the graph on disk is unchanged.

The shifted weights are written once per weights version into a file beside weights.bin (SHIFTED_FILE; into the
per-user cache where the artifact is read-only), and the rewritten graph reads them as external data: ORT maps and
packs them as it does weights.bin, so memory stays one copy. (Shifting inside the graph, with nodes ORT folds at
session build, held several copies at once: a 7B w8a8 load went past 24 GB; handing ORT memory-mapped arrays kept
their pages resident through the build: 1.7x the weights.)
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .cache import CACHE_ENV, cache_root

log = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (MatMulIntegerToFloat, MatMulNBits)
# CPU flags (Linux /proc/cpuinfo names) under which MLAS's u8s8 kernel sums its products exactly.
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
# ONNX Runtime's session option naming the folder a graph's external weights are read from, for a graph built from
# bytes rather than from its file.
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
CPUINFO = Path("/proc/cpuinfo")
SHIFTED_DIR = "int8-gemm"  # under cache_root(): a folder per read-only artifact's weights version
ALIGN = 64
ORIGIN = "origin.txt"  # in each cache folder: the artifact folder it was made for
_SHIFT = "pg_int8_gemm_shift"
_ZERO_POINT = "pg_int8_gemm_zero_point"


def _x86_flags() -> frozenset[str] | None:
    """The CPU's feature flags on x86 (None elsewhere: ARM's int8 kernels accumulate exactly)."""
    if platform.machine().lower() not in {"x86_64", "amd64", "i386", "i686"}:
        return None
    try:
        line = next(line for line in CPUINFO.read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return frozenset()  # flags unknown: assume the saturating kernel, the safe side
    return frozenset(line.split(":", 1)[1].split())


@cache
def u8s8_saturates() -> bool:
    """Whether ONNX Runtime's u8s8 GEMM can saturate on this CPU (x86 without VNNI)."""
    flags = _x86_flags()
    return flags is not None and not flags & VNNI_FLAGS


def _external(w: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in w.external_data}


# Beside the graph's weights.bin (not *.bin: the KV pool's default size counts those as the weights, kv_pools.py).
SHIFTED_FILE = "int8-gemm-shifted.u8"
KEY_FILE = "int8-gemm-shifted.key"  # which weights version SHIFTED_FILE was made from


def _copy(source: Path, target: Path) -> None:
    if target.exists() and target.stat().st_size == source.stat().st_size:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as out, open(source, "rb") as src:
        shutil.copyfileobj(src, out, 1 << 24)
    os.replace(out.name, target)


def _shifted_folder(folder: Path, weights: list[onnx.TensorProto], locations: set[str]) -> tuple[Path, list[int]]:
    """The folder the graph then reads all its external data from, holding `weights` (external data in `folder`)
    + 128 as uint8 in SHIFTED_FILE, written once per weights version; the weights' offsets in it. That is `folder`
    itself where it is writable (the file goes with the artifact), else a cache folder with a copy of the graph's
    other weights files: ORT reads one folder's external data and follows no link out of it, and onnx refuses
    hard-linked weights files."""
    key = hashlib.sha256()
    for location in sorted(locations):
        stat = (folder / location).stat()
        key.update(f"{(folder / location).resolve()}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    offsets, end = [], 0
    for w in weights:
        info = _external(w)
        key.update(f"{w.name}:{info['location']}:{info.get('offset', 0)}:{info['length']};".encode())
        offsets.append(end)
        end += -(-int(info["length"]) // ALIGN) * ALIGN
    digest = key.hexdigest()[:32]
    place = folder if os.access(folder, os.W_OK) else shifted_dir() / digest
    if place != folder:
        log.warning("%s is read-only: the int8 weights shifted for this CPU and a copy of the graph's other weights "
                    "go to %s (once; %s moves the cache)", folder, place, CACHE_ENV)
        _forget_older(folder, place)
        for location in locations:
            _copy(folder / location, place / location)
        (place / ORIGIN).write_text(str(folder.resolve()))
    path, stamp = place / SHIFTED_FILE, place / KEY_FILE
    if path.exists() and stamp.exists() and stamp.read_text() == digest:
        return place, offsets
    with tempfile.NamedTemporaryFile(dir=place, delete=False) as out:
        for w, offset in zip(weights, offsets):
            info = _external(w)
            source = np.memmap(folder / info["location"], np.uint8, "r", int(info.get("offset", 0)),
                               (int(info["length"]),))
            out.seek(offset)
            for begin in range(0, source.size, 1 << 24):  # 16 MiB at a time: the copy never sits in memory
                out.write((source[begin:begin + (1 << 24)] ^ np.uint8(0x80)).tobytes())
            del source
        out.truncate(end)
    os.chmod(out.name, 0o644)  # as readable as the weights it was made from
    os.replace(out.name, path)
    stamp.write_text(digest)
    return place, offsets


def forget_shifted(folder: Path) -> None:
    """Remove the shifted weights written beside `folder`'s weights (the export's own checks wrote them into the
    artifact it builds, which must not carry them)."""
    for name in (SHIFTED_FILE, KEY_FILE):
        (folder / name).unlink(missing_ok=True)


def _forget_older(folder: Path, keep: Path) -> None:
    """Delete the cache folders made for earlier versions of a read-only `folder`'s weights (a re-export)."""
    origin = str(folder.resolve())
    for other in shifted_dir().glob(f"*/{ORIGIN}"):
        if other.parent != keep and other.read_text() == origin:
            shutil.rmtree(other.parent, ignore_errors=True)


@dataclass(frozen=True)
class Shifted:
    """What `exact_int8_gemm` did: how many nodes it rewrote, and the folder the graph's external weights are now
    read from (None: where they were)."""

    nodes: int = 0
    folder: Path | None = None

    def external_folder(self, folder: Path) -> Path:
        return self.folder or folder


def exact_int8_gemm(model: onnx.ModelProto, folder: Path | None = None) -> Shifted:
    """Rewrite `model`'s u8s8 `MatMulIntegerToFloat` nodes to u8u8 in place: weights + 128, zero point 128. A weight
    stored in the graph is shifted there; one in external data (in `folder`) is read shifted from a cache folder
    (`Shifted.folder`, then the folder of all the graph's external data); one fed as a graph input (an op alone) is
    shifted by nodes in the graph. Only weights that nothing else reads are rewritten; only the main graph holds such
    nodes (Linear.w8a8 lowers inline)."""
    graph = model.graph
    stored = {w.name: w for w in graph.initializer if w.data_type == TensorProto.INT8}
    fed = {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.INT8}
    readers = Counter(name for n in graph.node for name in n.input)
    targets = [i for i, n in enumerate(graph.node) if n.op_type == "MatMulIntegerToFloat" and n.domain == MS_DOMAIN
               and len(n.input) > 1 and (n.input[1] in stored or n.input[1] in fed)
               and (len(n.input) < 6 or not n.input[5])]
    mine = Counter(graph.node[i].input[1] for i in targets)
    targets = [i for i in targets if mine[graph.node[i].input[1]] == readers[graph.node[i].input[1]]]
    if not targets:
        return Shifted()
    names = list(dict.fromkeys(graph.node[i].input[1] for i in targets))
    external = [stored[n] for n in names if n in stored and stored[n].data_location == TensorProto.EXTERNAL]
    place = None
    if external:
        if folder is None:
            raise ValueError("the graph's int8 weights are external data: name the folder they are read from")
        locations = {_external(w)["location"] for w in graph.initializer if w.data_location == TensorProto.EXTERNAL}
        place, offsets = _shifted_folder(folder, external, locations)
        for w, offset in zip(external, offsets):
            length = _external(w)["length"]
            w.data_type = TensorProto.UINT8
            del w.external_data[:]
            for key, value in (("location", SHIFTED_FILE), ("offset", str(offset)), ("length", length)):
                w.external_data.add(key=key, value=value)
    for name in names:
        if name in stored and stored[name].data_location != TensorProto.EXTERNAL:
            codes = numpy_helper.to_array(stored[name])
            stored[name].CopyFrom(numpy_helper.from_array(codes.view(np.uint8) ^ np.uint8(0x80), name))
    graph.initializer.append(numpy_helper.from_array(np.array(128, np.uint8), _ZERO_POINT))
    rewritten: list[onnx.NodeProto] = []
    widened: set[str] = set()
    for i, original in enumerate(graph.node):
        node = onnx.NodeProto()
        node.CopyFrom(original)
        weight = node.input[1] if i in targets else ""
        if weight in fed:
            if weight not in widened:  # right before its first reader: a split graph keeps it in one part
                widened.add(weight)
                if _SHIFT not in {w.name for w in graph.initializer}:
                    graph.initializer.append(numpy_helper.from_array(np.array(128, np.int16), _SHIFT))
                rewritten += [helper.make_node("Cast", [weight], [f"{weight}.int16"], to=TensorProto.INT16),
                              helper.make_node("Add", [f"{weight}.int16", _SHIFT], [f"{weight}.plus128"]),
                              helper.make_node("Cast", [f"{weight}.plus128"], [f"{weight}.uint8"],
                                               to=TensorProto.UINT8)]
            node.input[1] = f"{weight}.uint8"
        if i in targets:
            node.input.extend([""] * (6 - len(node.input)))  # up to b_zero_point (a_zero_point stays as it is)
            node.input[5] = _ZERO_POINT
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)
    return Shifted(len(targets), place)


def fit_int8_gemm(model: onnx.ModelProto, folder: Path | None = None) -> Shifted:
    """`exact_int8_gemm` where this CPU's u8s8 GEMM saturates; else nothing."""
    return exact_int8_gemm(model, folder) if u8s8_saturates() else Shifted()


def shifted_dir() -> Path:
    """Where the shifted weights' folders live (their pages are given back after a session build, as weights.bin's)."""
    return cache_root() / SHIFTED_DIR


def cpu_session(graph: Path | onnx.ModelProto, options: Any, folder: Path | None = None) -> Any:
    """An ONNX Runtime session over an artifact graph, its int8 GEMMs exact on this CPU: a graph file (its external
    weights beside it), or a model whose external weights are in `folder`."""
    import onnxruntime as ort

    providers = ["CPUExecutionProvider"]
    path = graph if isinstance(graph, Path) else None
    if path is not None:
        if not u8s8_saturates():
            return ort.InferenceSession(str(path), options, providers=providers)
        folder, graph = path.parent, onnx.load_model(path, load_external_data=False)
    shifted = fit_int8_gemm(graph, folder)
    if path is not None and not shifted.nodes:  # nothing to rewrite (no w8a8 linears): the file as it is
        return ort.InferenceSession(str(path), options, providers=providers)
    if folder is not None:
        options.add_session_config_entry(EXTERNAL_FOLDER, str(shifted.external_folder(folder)))
    return ort.InferenceSession(graph.SerializeToString(), options, providers=providers)
