"""GroupedMatmulNBits kernel microbenchmark: this checkout's kernel beside another git revision's, at MoE shapes.

The MoE decode step is bound by the expert kernel: at B = 1 each chosen expert gets one row, so the
kernel must stream its weights as fast as memory allows. Timings on a shared machine are noisy, so both kernels run
in one process, alternating, and the figure is their ratio. The baseline is built from `--baseline-rev`'s
cpu_kernels sources (git show) with the same compiler flags (cpu_kernels/build.py), both libraries called through
ctypes, `pg_grouped_matmul_nbits` directly, on random codes at OLMoE's expert shapes (64 experts, top-8, hidden 2048,
expert intermediate 1024): gate/up [2048, 2048] and down [2048, 1024], 8-bit with one block per row (the exporter's
per-channel int8: blocks of 256, shared zero point 128 and zero minimum) and 4-bit in blocks of 32 (the exporter's
default group, per-expert zero points and float16 minima), accuracy_level 4.

A real decode step reads each layer's experts from memory (OLMoE's experts are gigabytes), so the weights are
streamed, not cached: each call reads another of several layers' worth of experts (`--pool-mb` in all, beyond the
last-level cache) with its own routing. One JSON line per (bits, projection, tokens): median milliseconds of each,
new / baseline, the weight bytes read per call over each kernel's time (GB/s), the largest difference between the
two outputs, and the machine.

    python scripts/grouped_matmul_bench.py --baseline-rev main --tokens 1 16 --bits 8 4
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
from moe_bench import machine
from pagedgraph.cpu_kernels.build import library_path

ROOT = Path(__file__).resolve().parent.parent
EXPERTS, TOP_K, HIDDEN, INTERMEDIATE = 64, 8, 2048, 1024
PROJECTIONS = {"gate_up": (2 * INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}  # N, K
BLOCK_SIZES = {8: 256, 4: 32}
FLOAT16 = 2  # kernels.h's pg_cache_dtype PG_CACHE_FLOAT16


def revision_sources(rev: str, into: Path) -> Path:
    """cpu_kernels' C++ sources and headers of git revision `rev`, written into `into`."""
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:cpu_kernels"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        if name.endswith((".cc", ".h")):
            (into / name).write_bytes(subprocess.run(["git", "show", f"{rev}:cpu_kernels/{name}"], cwd=ROOT,
                                                     check=True, capture_output=True).stdout)
    return into


def load(path: Path, threads: int) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.pg_set_threads(ctypes.c_int(threads))
    lib.pg_last_error.restype = ctypes.c_char_p
    return lib


def layer(rng: np.random.Generator, bits: int, n: int, k: int) -> dict[str, np.ndarray]:
    """One layer's random codes and parts in the op's layout."""
    block = BLOCK_SIZES[bits]
    blocks = k // block
    parts = {"codes": rng.integers(0, 256, (EXPERTS, n, blocks * block * bits // 8), dtype=np.uint8),
             "scales": (rng.random((EXPERTS, n, blocks), dtype=np.float32) * 0.01 + 0.001)}
    if bits == 8:
        parts["zero_points"] = np.full((1, n, blocks), 128, np.uint8)
        parts["minimum_t"] = np.zeros((1, blocks, n), np.float16)
    else:
        parts["zero_points"] = rng.integers(0, 256, (EXPERTS, n, (blocks + 1) // 2), dtype=np.uint8)
        parts["minimum_t"] = (rng.standard_normal((EXPERTS, blocks, n)) * 0.01).astype(np.float16)
    return parts


def routing(rng: np.random.Generator, tokens: int) -> np.ndarray:
    """Rows per expert (group_list counts) of `tokens` tokens routed to TOP_K distinct experts each."""
    routes = np.concatenate([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(tokens)])
    return np.bincount(routes, minlength=EXPERTS).astype(np.int64)


def streamed_bytes(parts: dict[str, np.ndarray], group_list: np.ndarray) -> int:
    """Weight bytes of the experts that received rows (shared parts counted once)."""
    used = int((group_list > 0).sum())
    return sum(parts[name][0].nbytes * (used if parts[name].shape[0] == EXPERTS else 1)
               for name in ("codes", "scales", "zero_points", "minimum_t"))


def call(lib: ctypes.CDLL, x: np.ndarray, parts: dict[str, np.ndarray], group_list: np.ndarray, y: np.ndarray,
         bits: int) -> None:
    codes = parts["codes"]
    ptr = lambda a: ctypes.c_void_p(a.ctypes.data)
    rc = lib.pg_grouped_matmul_nbits(
        ptr(x), ptr(codes), ptr(parts["scales"]), ptr(parts["zero_points"]),
        ctypes.c_int32(parts["zero_points"].shape[0] == EXPERTS), ptr(parts["minimum_t"]), ctypes.c_int32(FLOAT16),
        ctypes.c_int32(parts["minimum_t"].shape[0] == EXPERTS), ptr(group_list), ctypes.c_int64(1), ptr(y),
        ctypes.c_int64(x.shape[0]), ctypes.c_int64(x.shape[1]), ctypes.c_int64(y.shape[1]), ctypes.c_int64(EXPERTS),
        ctypes.c_int64(bits), ctypes.c_int64(BLOCK_SIZES[bits]), ctypes.c_int32(4), None)
    if rc:
        raise RuntimeError(lib.pg_last_error().decode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="main", help="git revision whose cpu_kernels are the baseline")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16], help="decode batch sizes (rows = 8 x)")
    parser.add_argument("--bits", type=int, nargs="+", default=[8, 4], choices=[8, 4])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30, help="timed calls of each kernel, alternating")
    parser.add_argument("--pool-mb", type=int, default=2048, help="weights cycled through (beyond the L3 cache)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        baseline = load(library_path(revision_sources(args.baseline_rev, Path(folder))), args.threads)
    new = load(library_path(), args.threads)
    rng = np.random.default_rng(0)
    for bits in args.bits:
        for projection, (n, k) in PROJECTIONS.items():
            for tokens in args.tokens:
                layers = [layer(rng, bits, n, k)]
                size = sum(part.nbytes for part in layers[0].values())
                layers += [layer(rng, bits, n, k) for _ in range(max(1, args.pool_mb * 2**20 // size) - 1)]
                x = rng.standard_normal((tokens * TOP_K, k)).astype(np.float32)
                outputs = {"baseline": np.empty((x.shape[0], n), np.float32)}
                outputs["new"] = np.empty_like(outputs["baseline"])
                seconds, streamed = {"baseline": [], "new": []}, {"baseline": [], "new": []}
                for run in range(args.runs + 1):  # the first calls warm up
                    for i, (name, lib) in enumerate((("baseline", baseline), ("new", new))):
                        parts, group_list = layers[(2 * run + i) % len(layers)], routing(rng, tokens)
                        start = time.perf_counter()
                        call(lib, x, parts, group_list, outputs[name], bits)
                        if run:
                            seconds[name].append(time.perf_counter() - start)
                            streamed[name].append(streamed_bytes(parts, group_list))
                group_list = routing(rng, tokens)
                for name, lib in (("baseline", baseline), ("new", new)):
                    call(lib, x, layers[0], group_list, outputs[name], bits)
                ms = {name: statistics.median(t) * 1e3 for name, t in seconds.items()}
                gb_s = {name: round(statistics.median(streamed[name]) / ms[name] / 1e6, 2) for name in ms}
                print(json.dumps({
                    "bits": bits, "projection": projection, "n": n, "k": k, "block_size": BLOCK_SIZES[bits],
                    "tokens": tokens, "rows": x.shape[0], "threads": args.threads, "layers": len(layers),
                    "baseline_rev": args.baseline_rev, "baseline_ms": round(ms["baseline"], 3),
                    "new_ms": round(ms["new"], 3), "new_over_baseline": round(ms["new"] / ms["baseline"], 3),
                    "baseline_gb_s": gb_s["baseline"], "new_gb_s": gb_s["new"],
                    "max_abs_diff": float(np.abs(outputs["new"] - outputs["baseline"]).max()),
                    "max_abs_output": float(np.abs(outputs["baseline"]).max()), **machine()}), flush=True)


if __name__ == "__main__":
    main()
