"""Load time, memory and speed of artifacts of growing size, side by side in one invocation (ratios to the first).

Each artifact runs in its own child process, one after the other, so each peak RSS is that artifact's alone:
load time (`LLMEngine` built: manifest, tokenizer, KV pool, ONNX Runtime session), the peak RSS of the load,
decode tok/s with 1 and 16 requests served together, prefill tok/s of one 512-token prompt (best of --rounds),
and the run's peak RSS beyond the weights and the KV pool's resident pages. "Flat" memory beyond the weights and
the KV pool reads as a beyond-RSS ratio near 1 from the first (smallest) artifact to the last.

    flock /tmp/pg-cpu.lock flock /tmp/pg-mem.lock python scripts/size_bench.py \\
        --artifact A135M --artifact A1B --artifact A7B --threads 2 --json docs/bench/sizes.json

Run it on an idle machine (it prints the load average before and after, and the CPU flags that pick the kernels).
A measurement script only: nothing in the tests or the runtime imports it.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile")


def _status_bytes(key: str) -> int:
    """A /proc/self/status figure (VmHWM, VmRSS, RssAnon, RssFile) in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(key + ":"))


def measure(artifact: str, threads: int | None, kv_cache_dtype: str, rounds: int, decode_tokens: int) -> dict[str, Any]:
    """One artifact, in this process (the child)."""
    from pagedgraph.runtime.bench import micro
    from pagedgraph.runtime.bench.metrics import resident_bytes
    from pagedgraph.runtime.bench.runner import run_engine, warm_up
    from pagedgraph.runtime.engine import EngineConfig, LLMEngine
    from pagedgraph.runtime.kv_pools import weights_bytes

    start = time.perf_counter()
    engine = LLMEngine(artifact, EngineConfig(threads=threads, kv_cache_dtype=kv_cache_dtype))
    load_s = time.perf_counter() - start
    load = {"load_s": load_s, "load_peak_rss_bytes": _status_bytes("VmHWM"), "after_load_rss_bytes":
            _status_bytes("VmRSS"), "after_load_anon_bytes": _status_bytes("RssAnon"),
            "after_load_file_bytes": _status_bytes("RssFile")}
    warm_up(engine)
    vocab = engine.model.vocab_size
    decode = micro.engine_concurrency(engine, (1, 16), 32, decode_tokens)
    prefill_s = []
    for seed in range(rounds):
        started = time.perf_counter()
        run_engine(engine, micro.random_requests(vocab, 1, 512, 1, 100 + seed))
        prefill_s.append(time.perf_counter() - started)
    weights, pool = weights_bytes(Path(artifact)), engine.runner.pools
    kv_resident = resident_bytes(pool.values())
    peak = _status_bytes("VmHWM")
    model = engine.model
    return {"artifact": Path(artifact).name, "precision": engine.manifest.precision(), "weights_bytes": weights,
            "model": {"hidden_size": model.hidden_size, "num_layers": model.num_layers,
                      "intermediate_size": model.intermediate_size, "vocab_size": model.vocab_size},
            **load, "kv_cache_dtype": engine.kv_cache_dtype, "kv_cache_blocks": pool.num_blocks,
            "kv_cache_bytes": pool.nbytes, "kv_cache_resident_bytes": kv_resident,
            "decode_tok_s_b1": decode["1"], "decode_tok_s_b16": decode["16"],
            "prefill_512_s": prefill_s, "prefill_512_tok_s": 512 / min(prefill_s),
            "peak_rss_bytes": peak, "rss_beyond_weights_kv_bytes": peak - weights - kv_resident,
            "rss_over_weights_kv_resident": peak / (weights + kv_resident),
            "rss_over_weights_kv_pool": peak / (weights + pool.nbytes),
            "end_anon_bytes": _status_bytes("RssAnon"), "end_file_bytes": _status_bytes("RssFile"),
            "load_avg_1m_end": os.getloadavg()[0]}


def _cpu_flags() -> list[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    return [f for f in KERNEL_FLAGS if f in flags]


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as cpuinfo:
        return next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown")


def _portable(argv: list[str]) -> list[str]:
    """The command line with each existing path as its last part (no machine paths in committed figures)."""
    return [Path(a).name if os.path.exists(a) else a for a in argv]


def _table(runs: list[dict[str, Any]]) -> str:
    base = runs[0]
    rows = ["| artifact | weights MB | load s | load peak MiB | decode B=1 tok/s | decode B=16 tok/s | "
            "prefill 512 tok/s | peak RSS MiB | beyond weights + KV MiB | vs first | peak / (weights + KV) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        mib = 2 ** 20
        rows.append(f"| {r['artifact']} | {r['weights_bytes'] / 1e6:,.0f} | {r['load_s']:.1f} | "
                    f"{r['load_peak_rss_bytes'] / mib:,.0f} | {r['decode_tok_s_b1']:.1f} | "
                    f"{r['decode_tok_s_b16']:.1f} | {r['prefill_512_tok_s']:.1f} | {r['peak_rss_bytes'] / mib:,.0f} | "
                    f"{r['rss_beyond_weights_kv_bytes'] / mib:,.0f} | "
                    f"{r['rss_beyond_weights_kv_bytes'] / base['rss_beyond_weights_kv_bytes']:.2f}x | "
                    f"{r['rss_over_weights_kv_resident']:.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", action="append", default=[], help="repeat, smallest first (the baseline)")
    parser.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engines' KV cache dtype")
    parser.add_argument("--rounds", type=int, default=3, help="512-token prefills per artifact (the best counts)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="outputs per request of the decode runs")
    parser.add_argument("--max-beyond-mib", type=float, default=256,
                        help="fail when an artifact's peak RSS beyond its weights and resident KV pool exceeds this")
    parser.add_argument("--rss-bound", type=float, default=1.15,
                        help="fail when an artifact of 5 GB of weights or more peaks above this x (weights + the KV "
                             "pool's resident pages)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.threads, args.kv_cache_dtype, args.rounds, args.decode_tokens)))
        return
    if not args.artifact:
        parser.error("give --artifact at least once")
    started = {"date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "load_avg_start": os.getloadavg(), "cpu": _cpu_model(), "cpu_flags": _cpu_flags(),
               "cores": os.cpu_count(), "command": " ".join(_portable(sys.argv))}
    print(f"load average {started['load_avg_start']}, CPU {started['cpu']} {started['cpu_flags']}", flush=True)
    runs = []
    for artifact in args.artifact:
        command = [sys.executable, __file__, "--child", artifact, "--kv-cache-dtype", args.kv_cache_dtype,
                   "--rounds", str(args.rounds), "--decode-tokens", str(args.decode_tokens)]
        if args.threads:
            command += ["--threads", str(args.threads)]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        if result.returncode:
            raise SystemExit(f"{artifact}: the child failed:\n{result.stderr[-4000:]}")
        runs.append(json.loads(result.stdout.splitlines()[-1]))
        print(f"{artifact}: load {runs[-1]['load_s']:.1f} s, decode B=1 {runs[-1]['decode_tok_s_b1']:.1f} tok/s, "
              f"peak {runs[-1]['peak_rss_bytes'] / 2**20:,.0f} MiB (load average {os.getloadavg()[0]:.2f})",
              flush=True)
    table = _table(runs)
    print(table)
    results = {**started, "load_avg_end": os.getloadavg(), "threads": args.threads, "runs": runs, "table": table}
    over = [f"{r['artifact']}: {r['rss_beyond_weights_kv_bytes'] / 2**20:,.0f} MiB beyond"
            for r in runs if r["rss_beyond_weights_kv_bytes"] > args.max_beyond_mib * 2**20]
    over += [f"{r['artifact']}: {r['rss_over_weights_kv_resident']:.3f}x" for r in runs
             if r["weights_bytes"] >= 5e9 and r["rss_over_weights_kv_resident"] > args.rss_bound]
    results["rss_checks"] = {"max_beyond_mib": args.max_beyond_mib, "rss_bound": args.rss_bound, "over": over}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    if over:
        raise SystemExit(f"memory checks failed: {', '.join(over)}")
    print(f"memory checks passed: at most {args.max_beyond_mib:.0f} MiB beyond weights + resident KV pool, and "
          f"at most {args.rss_bound}x (weights + resident KV pool) from 5 GB of weights up")


if __name__ == "__main__":
    main()
