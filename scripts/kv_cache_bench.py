"""KV-cache dtypes side by side in ONE process (run it with the cores otherwise idle): blocks per budget, decode step
time at 16 x 64 and 16 x 1,024 tokens of context, and the mixed workload on a pool that preempts at float32.

    python scripts/kv_cache_bench.py --artifact ART --json docs/bench/kv_cache.json

The artifact needs graphs for every dtype compared (export.kv_cache_dtypes). Decode steps are measured in
alternating rounds (each dtype once per round, the fastest step of each kept), so a change in the machine's load
hits every dtype alike.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.graphs.kv_cache import bytes_per_block
from pagedgraph.runtime.bench import micro, workloads
from pagedgraph.runtime.bench.runner import run_engine, warm_up
from pagedgraph.runtime.engine import EngineConfig, LLMEngine


def _engine(artifact: str, dtype: str, threads: int | None, **config: Any) -> LLMEngine:
    engine = LLMEngine(artifact, EngineConfig(threads=threads, kv_cache_dtype=dtype, **config))
    warm_up(engine)
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16,int8", help="the first is the baseline")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--budget", type=int, default=1 << 30, help="kv_cache_bytes of the blocks-per-budget figure")
    parser.add_argument("--rounds", type=int, default=3, help="alternating decode-step rounds")
    parser.add_argument("--contexts", default="64,1024")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mixed-requests", type=int, default=32, dest="mixed_requests")
    parser.add_argument("--mixed-budget-blocks", type=int, default=160, dest="mixed_blocks",
                        help="the mixed run's pool, in float32 blocks (its kv_cache_bytes): small enough to preempt")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",")
    contexts = [int(c) for c in args.contexts.split(",")]
    out: dict[str, Any] = {"artifact": args.artifact, "dtypes": dtypes, "budget_bytes": args.budget}

    engines = {d: _engine(args.artifact, d, args.threads, kv_cache_bytes=args.budget) for d in dtypes}
    out["blocks_per_budget"] = {d: e.runner.pools.num_blocks for d, e in engines.items()}
    out["bytes_per_block"] = {d: e.runner.pools.bytes_per_block for d, e in engines.items()}
    steps: dict[str, dict[int, float]] = {d: {} for d in dtypes}
    for _ in range(args.rounds):
        for ctx in contexts:
            for d, engine in engines.items():
                seconds = micro.engine_decode_step_s(engine, [ctx] * args.batch)
                steps[d][ctx] = min(steps[d].get(ctx, seconds), seconds)
        print(f"decode step s: {steps}", file=sys.stderr)
    out["decode_step_s"] = {d: {str(c): s for c, s in v.items()} for d, v in steps.items()}
    base = dtypes[0]
    out["decode_step_speedup"] = {d: {str(c): steps[base][c] / steps[d][c] for c in contexts} for d in dtypes}
    del engines
    gc.collect()

    budget = args.mixed_blocks * _engine_bytes_per_block(args.artifact, base)
    out["mixed_kv_cache_bytes"] = budget
    out["mixed"] = {}
    for d in dtypes:
        engine = _engine(args.artifact, d, args.threads, kv_cache_bytes=budget)
        requests = workloads.mixed(engine.model.vocab_size, args.mixed_requests, seed=0)
        record = run_engine(engine, requests)
        figures = record.figures()
        out["mixed"][d] = {"kv_cache_blocks": engine.runner.pools.num_blocks, "preemptions": figures["preemptions"],
                           "total_s": figures["total_s"], "throughput_tok_s": figures["throughput_tok_s"],
                           "steps": figures["steps"]}
        print(f"mixed {d}: {out['mixed'][d]}", file=sys.stderr)
        del engine
        gc.collect()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def _engine_bytes_per_block(artifact: str, dtype: str) -> int:
    manifest = Manifest.load(Path(artifact), verify=False)
    model = manifest.model
    return bytes_per_block(manifest.kv_cache_dtype(dtype), model.num_layers, manifest.block_size, model.kv_size)


if __name__ == "__main__":
    sys.exit(main())
