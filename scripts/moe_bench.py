"""MoE FFN microbenchmark: pagedgraph's sparse FFN (graphs/moe.py; GroupedMatmul as the oneDNN custom op) beside
ONNX Runtime's fused `com.microsoft.MoE`, on one layer of random float32 weights, per expert count and step size.

Prints one JSON line per (experts, tokens) with the median milliseconds of each, their ratio, the largest difference
between their outputs, and the machine (CPU model and flags, load average): the figures of docs/bench/history.md,
"Mixture of experts". Both graphs take the weights as inputs (one copy, fed without a copy; `--initializers` makes
them initializers of the fused op's graph instead, to check that its kernel does not prefer constant weights);
runs alternate between them.

    python scripts/moe_bench.py --experts 8 64 --tokens 1 16 256
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from pagedgraph.cpu_kernels.build import ort_library_path
from pagedgraph.exporter.onnx.graph_builder import FragmentBuilder
from pagedgraph.graphs.config import MoeConfig
from pagedgraph.graphs.moe import moe_weight_names, routed_experts
from pagedgraph.graphs.weight_forms import WeightForms


def machine() -> dict[str, object]:
    info = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    return {"cpu": model, "flags": [f for f in wanted if f in flags], "loadavg": os.getloadavg()}


def ours(moe: MoeConfig, hidden: int) -> bytes:
    names = moe_weight_names(0)
    shapes = {names[0]: (moe.num_experts, hidden),
              names[1]: (moe.num_experts, 2 * moe.intermediate_size, hidden),
              names[2]: (moe.num_experts, hidden, moe.intermediate_size)}
    b = FragmentBuilder({n: np.empty(s, np.float32) for n, s in shapes.items()}, inline=False)
    b.output("y", routed_experts(b, moe, WeightForms(), b.input("x"), 0))
    return b.model("pagedgraph-moe").SerializeToString()


def onnxruntime_moe(moe: MoeConfig, h: int, weights: dict[str, np.ndarray] | None = None) -> bytes:
    """Router Gemm, then com.microsoft.MoE with SwiGLU experts (gate and up rows interleaved in fc1); `weights`
    given, they are the graph's initializers."""
    e, i = moe.num_experts, moe.intermediate_size
    info = helper.make_tensor_value_info
    nodes = [helper.make_node("Gemm", ["x", "router"], ["logits"], transB=1),
             helper.make_node("MoE", ["x", "logits", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=moe.top_k,
                              activation_type="swiglu", swiglu_fusion=1,
                              normalize_routing_weights=int(moe.norm_topk_prob))]
    graph = helper.make_graph(nodes, "ort-moe", [info("x", TensorProto.FLOAT, ["T", h]),
                                                 info("router", TensorProto.FLOAT, [e, h]),
                                                 info("fc1", TensorProto.FLOAT, [e, 2 * i, h]),
                                                 info("fc2", TensorProto.FLOAT, [e, h, i])],
                              [info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, name) for name, w in (weights or {}).items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return model.SerializeToString()


def session(model: bytes, threads: int, library: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # two sessions in one process
    if library:
        options.register_custom_ops_library(str(ort_library_path()))
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def measure(moe: MoeConfig, h: int, token_counts: list[int], repeats: int, threads: int, seed: int,
            initializers: bool) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    e, i = moe.num_experts, moe.intermediate_size
    router = rng.standard_normal((e, h), np.float32)
    gate_up = (rng.standard_normal((e, 2 * i, h), np.float32) * 0.02).astype(np.float32)
    down = (rng.standard_normal((e, h, i), np.float32) * 0.02).astype(np.float32)
    interleaved = np.empty_like(gate_up)  # ORT's fc1: g0, u0, g1, u1, ...
    interleaved[:, 0::2], interleaved[:, 1::2] = gate_up[:, :i], gate_up[:, i:]
    names = moe_weight_names(0)
    mine = session(ours(moe, h), threads, library=True)
    their_weights = {"router": router, "fc1": interleaved, "fc2": down}
    theirs = session(onnxruntime_moe(moe, h, their_weights if initializers else None), threads, library=False)
    feeds = {"pagedgraph": dict(zip(names, (router, gate_up, down))), "ort_moe": {} if initializers else their_weights}
    rows = []
    for tokens in token_counts:
        x = rng.standard_normal((tokens, h), np.float32)
        difference = float(np.abs(mine.run(None, {"x": x, **feeds["pagedgraph"]})[0] -
                                  theirs.run(None, {"x": x, **feeds["ort_moe"]})[0]).max())
        times: dict[str, list[float]] = {"pagedgraph": [], "ort_moe": []}
        for _ in range(repeats):
            for name, s in (("pagedgraph", mine), ("ort_moe", theirs)):
                feed = {"x": x, **feeds[name]}
                start = time.perf_counter()
                s.run(None, feed)
                times[name].append(time.perf_counter() - start)
        median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        rows.append({"experts": e, "tokens": tokens, "top_k": moe.top_k, "hidden": h, "intermediate": i,
                     "pagedgraph_ms": round(median["pagedgraph"], 3), "ort_moe_ms": round(median["ort_moe"], 3),
                     "ort_moe_over_pagedgraph": round(median["ort_moe"] / median["pagedgraph"], 3),
                     "max_abs_difference": difference, "repeats": repeats, "threads": threads,
                     "ort_moe_weights": "initializers" if initializers else "inputs", **machine()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--initializers", action="store_true", help="the fused op's weights as initializers")
    args = parser.parse_args()
    by_experts = {}
    for experts in args.experts:
        moe = MoeConfig(experts, args.top_k, args.intermediate, norm_topk_prob=False, sparse_layers=(0,))
        by_experts[experts] = measure(moe, args.hidden, args.tokens, args.repeats, args.threads, args.seed,
                                      args.initializers)
    if len(args.experts) == 2 and 1 in args.tokens:  # the target: a B=1 step's MoE time follows k, not E
        few, many = (next(r for r in by_experts[e] if r["tokens"] == 1) for e in sorted(args.experts))
        print(json.dumps({"decode_b1_time_ratio": round(many["pagedgraph_ms"] / few["pagedgraph_ms"], 3),
                          "experts": sorted(args.experts), "target": "<= 1.2"}))


if __name__ == "__main__":
    main()
