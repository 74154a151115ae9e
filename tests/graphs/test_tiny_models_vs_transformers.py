"""Exported ONNX bucket graphs, run by the engine, against HF transformers on the same tiny checkpoints.

Covers what SmolLM2 does not: untied LM heads, Qwen2's q/k/v bias, Mistral, llama3 rope scaling, Qwen3's per-head
q/k norms with a head_dim of its own, Phi-3's fused qkv_proj and gate_up_proj, Mixture-of-Experts layers (Qwen3-MoE
with and without norm_topk_prob, beside a dense layer, with its experts fused as transformers 5 can save them;
Mixtral).
The engine's reported logprobs (top-5 of every generated token) must equal transformers' fp32
log-softmax, and greedy tokens must match.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export
from pagedgraph.graphs import models
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.sampling_params import SamplingParams
from tests.tiny_models import make_tiny_hf_checkpoint

pytestmark = pytest.mark.unit
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Tiny MoE layers: 8 experts of width 32 (Qwen3-MoE's dense layers keep TINY_DIMS' intermediate_size); Mixtral's
# intermediate_size is its experts' width.
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48}
CASES = {
    "llama-tied": dict(arch="llama", tie=True),
    "llama-untied-llama3-rope": dict(arch="llama", tie=False,
                                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mistral": dict(arch="mistral", tie=False),
    "qwen2-bias-bf16": dict(arch="qwen2", tie=False, dtype="bfloat16"),
    "qwen3-tied-head-dim-32": dict(arch="qwen3", tie=True, dims={"head_dim": 32}),  # q 4 x 32 over hidden 64
    "qwen3-untied": dict(arch="qwen3", tie=False),
    "phi3-fused-qkv-gate-up": dict(arch="phi3", tie=False),
    "qwen3-moe-norm-topk-dense-layer": dict(arch="qwen3_moe", tie=False, dims=QWEN3_MOE | {"mlp_only_layers": [1]}),
    "qwen3-moe-softmax-weights-fused": dict(arch="qwen3_moe", tie=True, fused_experts=True,
                                            dims=QWEN3_MOE | {"norm_topk_prob": False, "num_experts_per_tok": 3}),
    "mixtral": dict(arch="mixtral", tie=False, dims=MIXTRAL),
}
PROMPTS = [[5, 17, 42], list(range(10, 60)), [7], list(range(100, 140, 3))]
NEW_TOKENS = 12


Reference = list[tuple[list[int], list[np.ndarray]]]  # per prompt of PROMPTS: greedy tokens, each step's log-softmax


def hf_reference(model: object) -> Reference:
    """`model`'s (a transformers fp32 model) greedy continuation of each of PROMPTS: computed once, checked against
    every engine that serves its weights."""
    return [_hf_greedy(model, prompt) for prompt in PROMPTS]


def _hf_greedy(model: object, prompt: list[int]) -> tuple[list[int], list[np.ndarray]]:
    ids = torch.tensor([prompt])
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(ids).logits[0, -1].double()
            logprobs.append(torch.log_softmax(logits, -1).numpy())
            tokens.append(int(logits.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    return tokens, logprobs


def test_every_registered_family_is_checked_against_transformers() -> None:
    """A family joins the registry with a tiny case here (the registry's test that every family exports)."""
    assert set(models.FAMILIES) <= {case["arch"] for case in CASES.values()}


@pytest.mark.parametrize("case", CASES)
def test_engine_matches_transformers(case: str, tmp_path: Path) -> None:
    model_dir = make_tiny_hf_checkpoint(tmp_path / "hf", **CASES[case])
    config = ExportConfig.model_validate({
        "model": {"source": str(model_dir)},
        "export": {"max_model_len": 128, "buckets": {"decode_batch": [1, 4], "prefill_tokens": [16, 64, 128],
                                                    "prefill_max_seqs": 4}},
    })
    export(config, tmp_path / "artifact", log=io.StringIO())
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert_engine_follows(tmp_path / "artifact", hf_reference(model), case)


def assert_engine_follows(artifact: Path, reference: Reference, label: str, **engine_config: object) -> None:
    """The engine's greedy tokens on PROMPTS equal the `reference`'s (`hf_reference`), and its top-5 logprobs the
    reference's log-softmax within 1e-4. `engine_config`: EngineConfig fields (executor, custom_ops, ...)."""
    engine = LLMEngine(artifact, EngineConfig(num_blocks=64, max_num_batched_tokens=64, **engine_config))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    seqs = {engine.add_request(p, params).request_id: p for p in PROMPTS}
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for (request_id, prompt), (want_tokens, want_logprobs) in zip(seqs.items(), reference, strict=True):
        out = done[request_id]
        assert out.token_ids == want_tokens, f"{label}: prompt {prompt[:5]}..."
        for step, (got, want) in enumerate(zip(out.logprobs, want_logprobs)):
            for token, value in got.items():
                assert abs(value - want[token]) < 1e-4, f"{label}: step {step} token {token}"
