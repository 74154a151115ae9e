"""ONNX Runtime's weight prepacking on and off, per kernel: load time, resident memory and step time, one invocation.

Each artifact's graph is loaded twice, each time in its own child process (so each RSS is that session's alone):
with prepacking (the engine's setting) and with `session.disable_prepacking`. Each child builds the session as
the engine does (custom ops, mapped weights paged out once it is built), then runs a decode step at B=1 and a 512-token
prefill step --runs times under ORT's profiler; the figures are wall ms per step and each op type's ms per step
(the profile, first run left out), plus the session's resident memory split into anonymous (private copies:
prepacked weights, arena) and file-backed (the mapped weights.bin) pages. The parent prints off/on ratios.

    flock /tmp/pg-cpu.lock python scripts/prepack_bench.py --artifact A1B --threads 2 --json docs/bench/prepack.json

A measurement script only: nothing in the tests or the runtime imports it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODES = ("on", "off")


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(key + ":"))


def measure(artifact: Path, prepack: bool, threads: int | None, runs: int) -> dict[str, Any]:
    """One session of `artifact`'s graph, in this process (the child)."""
    import numpy as np
    import onnxruntime as ort

    from pagedgraph.artifact.manifest import Manifest
    from pagedgraph.graphs.contract import DECODE, LOGITS, PREFILL
    from pagedgraph.cpu_kernels.int8_gemm import cpu_session
    from pagedgraph.runtime.bench.kernels import per_op_times, step_feed
    from pagedgraph.runtime.executor_ort import (page_out_weights, pool_values, register_custom_ops, run_options,
                                                 session_options, step_binding)
    from pagedgraph.runtime.kv_pools import KVPools

    manifest = Manifest.load(artifact, verify=False)
    graph = artifact / manifest.served_graph(manifest.dtype)  # both phases run this graph
    before = {key: _status_mib(key) for key in ("RssAnon", "RssFile")}
    with tempfile.TemporaryDirectory(prefix="pagedgraph-prepack-") as scratch:
        options = session_options(threads, prepack)
        register_custom_ops(options, "auto")
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(scratch) / "profile")
        start = time.perf_counter()
        session = cpu_session(graph, options)
        page_out_weights(artifact / "graphs")
        out: dict[str, Any] = {"prepack": prepack, "load_s": time.perf_counter() - start,
                               "load_peak_mib": _status_mib("VmHWM"),
                               **{f"{k}_after_load_mib": _status_mib(k) - v for k, v in before.items()}}
        prefill = [g for g in manifest.families[PREFILL].gears if g.tokens >= 512 and g.blocks * manifest.block_size
                   >= 512]
        gears = {"decode_b1": min(manifest.families[DECODE].gears, key=lambda g: (g.seqs, g.blocks)),
                 "prefill_512": min(prefill, key=lambda g: (g.tokens, g.seqs, g.blocks))}
        marks = []
        for name, gear in gears.items():
            logits = np.zeros((gear.seqs, manifest.model.vocab_size), np.float32)
            pools = KVPools(manifest, gear.blocks + 1)
            binding = step_binding(session, step_feed(gear, manifest.block_size), pool_values(pools), LOGITS, logits)
            times = []
            for _ in range(runs + 1):  # the first also warms the arena: left out
                started = time.perf_counter()
                session.run_with_iobinding(binding, run_options())
                times.append(time.perf_counter() - started)
            out[name] = {"gear": [gear.tokens, gear.seqs, gear.blocks], "ms": 1e3 * min(times[1:])}
            marks.append(name)
        events = json.loads(Path(session.end_profiling()).read_text())
    steps = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    for index, name in enumerate(marks):  # each gear's runs: its own slice of the profile
        slice_ = steps[index * (runs + 1):(index + 1) * (runs + 1)]
        lo, hi = slice_[0]["ts"], slice_[-1]["ts"] + slice_[-1]["dur"]
        inside = [e for e in events if lo <= e.get("ts", -1) <= hi]
        out[name]["ops"] = per_op_times(inside, runs)
    out.update({f"{k}_end_mib": _status_mib(k) - v for k, v in before.items()})
    out["peak_mib"] = _status_mib("VmHWM")
    return out


def _ratios(on: dict[str, Any], off: dict[str, Any]) -> list[str]:
    lines = [f"load {off['load_s']:.1f} s off / {on['load_s']:.1f} s on; anonymous after load "
             f"{off['RssAnon_after_load_mib']:,.0f} / {on['RssAnon_after_load_mib']:,.0f} MiB, file-backed "
             f"{off['RssFile_after_load_mib']:,.0f} / {on['RssFile_after_load_mib']:,.0f} MiB; load peak "
             f"{off['load_peak_mib']:,.0f} / {on['load_peak_mib']:,.0f} MiB"]
    for step in ("decode_b1", "prefill_512"):
        lines.append(f"{step}: {off[step]['ms']:.1f} ms off / {on[step]['ms']:.1f} ms on = "
                     f"{off[step]['ms'] / on[step]['ms']:.2f}x")
        for op, entry in list(on[step]["ops"].items())[:8]:
            slow = off[step]["ops"].get(op, {}).get("ms", 0.0)
            lines.append(f"  {op}: {slow:.2f} / {entry['ms']:.2f} ms ({entry['calls']} calls) = "
                         f"{slow / entry['ms'] if entry['ms'] else 0:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", action="append", default=[], type=Path, help="repeatable")
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    parser.add_argument("--runs", type=int, default=3, help="profiled runs per step (the first more is left out)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.artifact[0], args.child == "on", args.threads, args.runs)))
        return
    if not args.artifact:
        parser.error("give --artifact at least once")
    results: dict[str, Any] = {"load_avg_start": os.getloadavg(), "threads": args.threads, "artifacts": {}}
    for artifact in args.artifact:
        runs = {}
        for mode in MODES:
            command = [sys.executable, __file__, "--child", mode, "--artifact", str(artifact), "--runs", str(args.runs)]
            command += ["--threads", str(args.threads)] if args.threads else []
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{artifact} ({mode}): the child failed:\n{done.stderr[-4000:]}")
            runs[mode] = json.loads(done.stdout.splitlines()[-1])
        results["artifacts"][artifact.name] = runs
        print(f"{artifact} (load average {os.getloadavg()[0]:.2f}):", *_ratios(runs["on"], runs["off"]), sep="\n  ")
    results["load_avg_end"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
