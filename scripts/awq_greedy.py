"""Greedy tokens of an artifact exported from an AWQ checkpoint against two references running the same checkpoint
(docs/performance.md, "Precision").

- `dequantized`: transformers fp32 with the checkpoint's float tensors and autoawq's float32 `dequantize_gemm` of
  every linear (the engine on an `accuracy_level: 0` artifact computes the same products in float32);
- `autoawq`: transformers with AutoAWQ's own `WQLinear_GEMM` modules built from the file (its torch path on CPU,
  which casts activations and weights to float16; HF transformers itself loads AWQ only through gptqmodel, and
  AutoAWQ's `from_quantized` only through intel_extension_for_pytorch on CPU).

Per prompt and reference: equal, or the first step where they part with both sides' logit margin there (the
reference's top-1 logit minus its logit of the engine's token; the engine's logprob of its token minus that of the
reference's). Needs torch, transformers and autoawq (`pip install --no-deps autoawq==0.2.9`).

    python scripts/awq_greedy.py --checkpoint /tmp/smollm2-awq/awq --artifact /tmp/smollm2-awq-artifact
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pagedgraph.runtime.engine import EngineConfig, LLMEngine  # noqa: E402
from pagedgraph.runtime.sampling_params import SamplingParams  # noqa: E402
from scripts.library_modules import bare_module  # noqa: E402
from scripts.make_reference import greedy_logits  # noqa: E402

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,")
PACKED = (".qweight", ".qzeros", ".scales")


def references(checkpoint: Path) -> dict[str, Any]:
    """The two reference models of the module docstring, float parts from the file."""
    config = AutoConfig.from_pretrained(checkpoint)
    group = config.quantization_config["group_size"]
    del config.quantization_config  # transformers would hand the model to gptqmodel
    state = {}
    for shard in sorted(checkpoint.glob("*.safetensors")):
        state |= load_file(str(shard))
    floats = {name: t for name, t in state.items() if not name.endswith(PACKED)}
    linears = [name[:-len(".qweight")] for name in state if name.endswith(".qweight")]
    packing = bare_module("awq.utils.packing_utils")
    gemm = bare_module("awq.modules.linear.gemm")
    gemm.TRITON_AVAILABLE = False  # a triton install found means CUDA/XPU kernels to it; the torch path runs on CPU
    models = {}
    for kind in ("dequantized", "autoawq"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        weights = {} if kind == "autoawq" else {f"{name}.weight": packing.dequantize_gemm(
            state[f"{name}.qweight"], state[f"{name}.qzeros"], state[f"{name}.scales"].float(), 4, group).T
            for name in linears}
        result = model.load_state_dict(floats | weights, strict=False)
        if kind == "autoawq":
            for name in linears:
                parent, _, child = name.rpartition(".")
                k, n = state[f"{name}.qweight"].shape[0], state[f"{name}.scales"].shape[1]
                module = gemm.WQLinear_GEMM(4, group, k, n, False, "cpu")
                module.qweight, module.qzeros, module.scales = (state[f"{name}{p}"] for p in PACKED)
                setattr(model.get_submodule(parent), child, module)
        missing = set(result.missing_keys) - {"lm_head.weight"} - {f"{n}.weight" for n in linears}
        if missing or result.unexpected_keys:
            raise SystemExit(f"{checkpoint}: tensors not read into the reference: {sorted(missing)} "
                             f"{result.unexpected_keys}")
        models[kind] = model
    return models


def compare(got: Any, want: list[int], want_logits: list[torch.Tensor]) -> dict[str, Any]:
    """Equal tokens, or the first step they part at with both margins; the top-5 logprob gap before it."""
    log_softmax = [torch.log_softmax(x, -1) for x in want_logits]
    parted = next((step for step, (a, b) in enumerate(zip(got.token_ids, want)) if a != b), None)
    steps = range(len(want) if parted is None else parted)
    gap = max((abs(value - float(log_softmax[s][token])) for s in steps for token, value in got.logprobs[s].items()),
              default=0.0)
    result: dict[str, Any] = {"equal": parted is None, "top5_logprob_max_abs_diff": gap}
    if parted is not None:
        ours, theirs = got.token_ids[parted], want[parted]
        engine = got.logprobs[parted]
        result |= {"first_divergence": parted, "engine_token": ours, "reference_token": theirs,
                   "reference_logit_margin": float(want_logits[parted][theirs] - want_logits[parted][ours]),
                   "engine_logprob_margin": engine[ours] - engine[theirs] if theirs in engine else None}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="the AWQ checkpoint (an HF directory)")
    parser.add_argument("--artifact", type=Path, required=True, help="exported from it, accuracy_level 0")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = LLMEngine(args.artifact, EngineConfig(num_blocks=64, max_model_len=1008, max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True, logprobs=5)
    requests = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    report = []
    for kind, model in references(args.checkpoint).items():
        for text, prompt, request in zip(PROMPTS, prompts, requests):
            want, logits = greedy_logits(model, prompt, args.tokens)
            report.append({"reference": kind, "prompt": text, **compare(done[request], want, logits),
                           "engine_text": tokenizer.decode(done[request].token_ids)})
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
