"""Exact int8 GEMM on every x86 CPU: ONNX Runtime's u8s8 kernel saturates where the CPU has no VNNI.

Linear.w8a8's ONNX body (exporter/onnx/quantized.py) feeds `MatMulIntegerToFloat` uint8 activations (the codes
+ 128) and int8 weights: MLAS's u8s8 GEMM. With VNNI (`vpdpbusd`: AVX-512 VNNI or AVX-VNNI) it sums every product
exactly in int32. Without it (AVX2, or AVX-512 without VNNI) MLAS adds pairs of u8 x s8 products in int16 with
saturation (`vpmaddubsw`): a code of 200 against a weight of 100 in two neighbouring columns already exceeds
32,767, and the output is off by up to a fifth of its range (docs/performance.md, "Which kernel runs"). ONNX
Runtime's documented remedy is the u8u8 form, which MLAS widens to 16 bits before multiplying, exactly and, on
AVX2, about as fast. So where the CPU lacks VNNI, `exact_int8_gemm` rewrites a loaded graph to u8u8: each int8
weight is shifted by 128 in the graph itself (Cast, Add, Cast over the initializer, which ORT folds into a uint8
constant when it builds the session, then packs as before) and gets the zero point 128. One artifact serves every
CPU; the graph on disk is unchanged.
"""
from __future__ import annotations

import platform
from functools import cache
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS_DOMAIN = "com.microsoft"
# CPU flags (Linux /proc/cpuinfo names) under which MLAS's u8s8 kernel sums its products exactly.
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
# ONNX Runtime's session option naming the folder a graph's external weights are read from, for a graph built from
# bytes rather than from its file.
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"
CPUINFO = Path("/proc/cpuinfo")
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


def _int8_values(graph: onnx.GraphProto) -> set[str]:
    """The graph's int8 weights: initializers (an artifact's graphs) or inputs (an op alone, fed its weights)."""
    return ({w.name for w in graph.initializer if w.data_type == TensorProto.INT8}
            | {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.INT8})


def exact_int8_gemm(model: onnx.ModelProto) -> int:
    """Rewrite `model`'s u8s8 `MatMulIntegerToFloat` nodes to u8u8 (weights + 128, zero point 128), in place; how
    many. Only the main graph holds such nodes (Linear.w8a8 lowers inline)."""
    graph = model.graph
    weights = _int8_values(graph)
    targets = {i for i, n in enumerate(graph.node) if n.op_type == "MatMulIntegerToFloat" and n.domain == MS_DOMAIN
               and len(n.input) > 1 and n.input[1] in weights and (len(n.input) < 6 or not n.input[5])}
    if not targets:
        return 0
    graph.initializer.extend([numpy_helper.from_array(np.array(128, np.int16), _SHIFT),
                              numpy_helper.from_array(np.array(128, np.uint8), _ZERO_POINT)])
    shifted: dict[str, str] = {}
    rewritten: list[onnx.NodeProto] = []
    for i, original in enumerate(graph.node):
        node = onnx.NodeProto()
        node.CopyFrom(original)
        if i in targets:
            weight = node.input[1]
            if weight not in shifted:  # widened right before its first reader: a split graph keeps it in one part
                wide, moved, shifted[weight] = f"{weight}.int16", f"{weight}.plus128", f"{weight}.uint8"
                rewritten += [helper.make_node("Cast", [weight], [wide], to=TensorProto.INT16),
                              helper.make_node("Add", [wide, _SHIFT], [moved]),
                              helper.make_node("Cast", [moved], [shifted[weight]], to=TensorProto.UINT8)]
            node.input[1] = shifted[weight]
            node.input.extend([""] * (6 - len(node.input)))  # up to b_zero_point (a_zero_point stays as it is)
            node.input[5] = _ZERO_POINT
        rewritten.append(node)
    del graph.node[:]
    graph.node.extend(rewritten)
    return len(targets)


def fit_int8_gemm(model: onnx.ModelProto) -> int:
    """`exact_int8_gemm` where this CPU's u8s8 GEMM saturates; how many nodes it rewrote."""
    return exact_int8_gemm(model) if u8s8_saturates() else 0


def session_source(graph: Path, options: object) -> str | bytes:
    """What to build an ONNX Runtime session over `graph` from: its file, or, where this CPU's u8s8 GEMM saturates
    and the graph has such nodes, the graph rewritten by `exact_int8_gemm` (`options`, an ort.SessionOptions, then
    reads the external weights from the graph's folder)."""
    if not u8s8_saturates():
        return str(graph)
    model = onnx.load_model(graph, load_external_data=False)
    if not fit_int8_gemm(model):
        return str(graph)
    options.add_session_config_entry(EXTERNAL_FOLDER, str(Path(graph).parent))  # type: ignore[attr-defined]
    return model.SerializeToString()
