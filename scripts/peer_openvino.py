"""OpenVINO GenAI on the bench's mixed workload and single stream: the same token ids, lengths and threads as ours.

Runs in its own venv (optimum-intel's exporter pins its own transformers; torch 2.13.0+cpu, the one on disk):

    python -m venv VENV && VENV/bin/pip install torch==2.13.0
    VENV/bin/pip install torch==2.13.0 openvino-genai==2026.4.1 openvino-tokenizers optimum-intel
    VENV/bin/pip uninstall -y torchvision  # built for another torch: transformers' import of it fails
    HF_HUB_OFFLINE=1 VENV/bin/optimum-cli export openvino --model HF --task text-generation-with-past \\
        --weight-format fp32 OV   # HF: the bundled GGUF as fp32 (scripts/peer_genai.py --make-hf HF)

For a checkpoint of more than 1B parameters, optimum-cli's default (no --weight-format) compresses the weights to
int8 (asymmetric, per channel: its log's "int8_asym, per-channel" for 156 of 157 layers at the 1.1B shape), the
peer of our w8a8: `optimum-cli export openvino --model CKPT --task text-generation-with-past OV`.

The workload comes from scripts/peer_workload.py (run in our env). Requests go to GenAI's
ContinuousBatchingPipeline (`add_request` with token ids, `step`, each handle read after every step, so each
token is timed when the pipeline returns it); greedy, `ignore_eos`, exactly `max_tokens` each; its scheduler at
its defaults. --precision default leaves the CPU plugin's choice (inference precision bf16 on a CPU with AVX-512
BF16, KV cache u8: the JSON records what the plugin reports); f32 sets INFERENCE_PRECISION_HINT and
KV_CACHE_PRECISION to f32, as our fp32 artifact computes and caches. One --precision per process:

    VENV/bin/python scripts/peer_openvino.py --model OV --workload W.json --precision default --json out.json

A measurement script only: nothing in the tests or the runtime imports it.
"""
from __future__ import annotations

import argparse
import platform
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterable

import numpy as np

import peer_workload

PRECISIONS = {"default": {}, "f32": {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}}


def plugin_precision(model: Path, properties: dict[str, Any]) -> dict[str, str]:
    """What the CPU plugin picks for this model and these properties (the pipeline compiles the same way)."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(model / "openvino_model.xml"), "CPU", properties)
    return {key: compiled.get_property(key).to_string() for key in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import openvino as ov
    import openvino_genai as genai

    workload = peer_workload.load(args.workload)
    properties = {**PRECISIONS[args.precision], "INFERENCE_NUM_THREADS": args.threads}
    pipe = genai.ContinuousBatchingPipeline(str(args.model), genai.SchedulerConfig(), "CPU", properties)
    handles: dict[str, Any] = {}

    def add(key: str, request: peer_workload.PeerRequest) -> None:
        config = genai.GenerationConfig(max_new_tokens=request.max_tokens, min_new_tokens=request.max_tokens,
                                        ignore_eos=True, do_sample=False)
        ids = ov.Tensor(np.array([request.prompt_token_ids], dtype=np.int64))
        handles[key] = pipe.add_request(len(handles), ids, config)

    def step() -> Iterable[tuple[str, int, bool]]:
        pipe.step()
        for key, handle in list(handles.items()):
            finished = handle.get_status() != genai.GenerationStatus.RUNNING
            count = sum(len(out.generated_ids) for out in handle.read().values()) if handle.can_read() else 0
            if count or finished:
                yield key, count, finished
            if finished:
                del handles[key]

    results = peer_workload.measure(workload, add, step)
    return {"engine": "openvino-genai", "versions": {name: version(name) for name in
                                                     ("openvino-genai", "openvino", "optimum-intel")},
            "precision_requested": args.precision, "properties": properties,
            "plugin_reports": plugin_precision(args.model, properties), "threads": args.threads,
            "cpu": platform.processor() or platform.machine(), "workload": workload.source, **results}


def main() -> None:
    parser = peer_workload.peer_parser(__doc__, "the OpenVINO IR directory (optimum-cli export)",
                                       "INFERENCE_NUM_THREADS")
    parser.add_argument("--precision", choices=sorted(PRECISIONS), default="default",
                        help="default: the CPU plugin's choice; f32: fp32 compute and KV cache")
    args = parser.parse_args()
    peer_workload.write(args.json, run(args))


if __name__ == "__main__":
    main()
