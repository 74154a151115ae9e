"""Which ONNX Runtime kernels an artifact's graph runs: one profiled decode and one profiled prefill step.

ORT's profile names each node's op type and execution provider. For MatMulNBits it does not name the
MLAS compute path, which the node's `accuracy_level` selects (0: float32 on dequantized blocks, MLAS
SQNBitGemm CompFp32; 4: activations quantized to int8 per block, CompInt8), so that attribute is reported
beside the timings. Linear.bfloat16 is one custom op (`Linear`) calling oneDNN, whose profile line names
only our kernel: the oneDNN implementation its primitives picked ("brg:avx512_core_bf16", ...) is read
from the library after the runs and reported beside it.
"""
from __future__ import annotations

import ctypes
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...artifact.manifest import Manifest
from ...graphs import contract as c
from ...graphs.contract import DECODE, PREFILL, Gear
from ...cpu_kernels.build import ort_library_path
from ...cpu_kernels.int8_gemm import cpu_session
from ..executor_ort import pool_values, register_custom_ops, run_options, session_options, step_binding
from ..executors import CustomOps
from ..kv_pools import KVPools

MLAS_PATHS = {0: "SQNBitGemm CompFp32", 1: "SQNBitGemm CompFp32", 2: "SQNBitGemm CompFp16",
              3: "SQNBitGemm CompBf16", 4: "SQNBitGemm CompInt8"}


def step_feed(gear: Gear, block_size: int) -> dict[str, np.ndarray]:
    """One real sequence filling the gear's first row (the rest padding), like a first step."""
    feed = {name: np.zeros(shape, c.INPUT_DTYPES[name]) for name, shape in gear.input_shapes().items()}
    tokens = gear.tokens if gear.seqs == gear.tokens else min(gear.tokens, gear.blocks * block_size)
    feed[c.POSITIONS][:tokens] = np.arange(tokens)
    feed[c.SLOT_MAPPING][:tokens] = block_size + np.arange(tokens)  # blocks 1.. (0 is the null block)
    feed[c.BLOCK_TABLES][0, :] = np.arange(1, gear.blocks + 1)
    feed[c.CONTEXT_LENS][0] = tokens if gear.seqs != gear.tokens else 1
    feed[c.CU_SEQLENS_Q][1:] = tokens if gear.seqs != gear.tokens else 1
    feed[c.LOGITS_INDICES][0] = (tokens if gear.seqs != gear.tokens else 1) - 1
    return feed


def profile_kernels(artifact: Path, threads: int | None, custom_ops: CustomOps, runs: int = 3) -> dict[str, Any]:
    """Per phase: {op type: {"provider", "calls" per step, "ms" per step}}, plus the MatMulNBits forms and the
    oneDNN implementation of Linear.bfloat16."""
    manifest = Manifest.load(artifact, verify=False)
    graph = artifact / manifest.served_graph(manifest.dtype)  # both phases run this graph
    out: dict[str, Any] = {"matmul_nbits": _nbits_forms(graph)}
    for phase in (DECODE, PREFILL):
        gear = min(manifest.families[phase].gears, key=lambda g: (g.tokens, g.blocks))
        with tempfile.TemporaryDirectory(prefix="pagedgraph-profile-") as scratch:
            options = session_options(threads)
            out["custom_ops"] = register_custom_ops(options, custom_ops)
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(scratch) / "profile")
            session = cpu_session(graph, options)
            logits = np.zeros((gear.seqs, manifest.model.vocab_size), np.float32)
            pools = KVPools(manifest, gear.blocks + 1)  # the graph's own cache dtype (auto)
            # Bound as the engine runs a step: the pools in place (a plain run copies every pool per layer).
            binding = step_binding(session, step_feed(gear, manifest.block_size), pool_values(pools), c.LOGITS, logits)
            run = run_options()
            for _ in range(runs + 1):  # the first run also prepacks: left out below
                session.run_with_iobinding(binding, run)
            events = json.loads(Path(session.end_profiling()).read_text())
        out[phase] = {"gear": [gear.tokens, gear.seqs, gear.blocks], "ops": per_op_times(events, runs)}
    if out["custom_ops"] and manifest.dtype == "bfloat16":
        out["linear_bfloat16"] = onednn_implementations()
    return out


def onednn_implementations() -> str:
    """The oneDNN implementations Linear.bfloat16 ran in this process (and oneDNN's version), "" if none: the
    custom-op library's PgBf16LinearImplementations (dlopen returns the copy ORT loaded)."""
    library = ctypes.CDLL(str(ort_library_path()))
    library.PgBf16LinearImplementations.restype = ctypes.c_char_p
    return library.PgBf16LinearImplementations().decode()


def per_op_times(events: list[dict[str, Any]], runs: int) -> dict[str, dict[str, Any]]:
    steps = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    start = steps[1]["ts"] if len(steps) > 1 else 0  # after the warm-up run
    ops: dict[str, dict[str, Any]] = {}
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time") or e["ts"] < start:
            continue
        args = e.get("args", {})
        entry = ops.setdefault(args.get("op_name", "?"), {"provider": args.get("provider"), "calls": 0, "ms": 0.0})
        entry["calls"] += 1
        entry["ms"] += e.get("dur", 0) / 1e3
    for entry in ops.values():
        entry["calls"] //= runs
        entry["ms"] = round(entry["ms"] / runs, 3)
    return dict(sorted(ops.items(), key=lambda kv: -kv[1]["ms"]))


def _nbits_forms(graph: Path) -> list[dict[str, Any]]:
    # Imported here, not with the module: the bench imports this module before the engine it measures, and onnx
    # added ~8 MiB to that process's peak RSS (its `rss_beyond_kv_bytes`), which no serving process carries.
    import onnx

    model = onnx.load_model(graph, load_external_data=False)
    forms: dict[tuple[int, int, int], int] = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            key = (attrs["bits"], attrs["block_size"], attrs.get("accuracy_level", 0))
            forms[key] = forms.get(key, 0) + 1
    return [{"bits": b, "block_size": s, "accuracy_level": a, "mlas": MLAS_PATHS.get(a, "?"), "nodes": n}
            for (b, s, a), n in sorted(forms.items())]
