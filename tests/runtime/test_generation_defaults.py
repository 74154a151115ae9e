"""Sampling defaults: the model's own (generation_config.json, recorded in the manifest), one max_tokens policy
for the CLI, `LLM` and the server, and temperature-1.0 sampling that follows the model's softmax."""
from __future__ import annotations

import io
import json
import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export
from pagedgraph.cli import main
from pagedgraph.runtime.deploy_config import Deployment
from pagedgraph.runtime.engine import LLM
from pagedgraph.runtime.sampling_params import DEFAULT_MAX_TOKENS, SamplingParams
from pagedgraph.runtime.server.launch import build_app
from tests.paths import REPO

pytestmark = pytest.mark.e2e
MAX_MODEL_LEN = 128
GENERATION = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "do_sample": True}


@pytest.fixture(scope="module")
def tiny_with_defaults(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny HF checkpoint whose generation_config.json sets sampling defaults, exported."""
    pytest.importorskip("transformers")
    from tests.tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("gen")
    checkpoint = make_tiny_hf_checkpoint(root / "hf")
    config_path = checkpoint / "generation_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **GENERATION}))
    config = ExportConfig.model_validate({"model": {"source": str(checkpoint)}, "export": {
        "max_model_len": MAX_MODEL_LEN, "verify_gears": False,
        "buckets": {"decode_batch": [4], "prefill_tokens": [64, 128], "prefill_max_seqs": 4}}})
    export(config, root / "artifact", log=io.StringIO())
    return root / "artifact"


def test_the_checkpoints_generation_config_is_recorded_and_applied(tiny_with_defaults: Path) -> None:
    manifest = Manifest.load(tiny_with_defaults)
    recorded = manifest.generation_defaults
    assert {k: v["value"] for k, v in recorded.items()} == {"temperature": 0.2, "top_p": 0.9, "top_k": 40,
                                                            "min_p": 0.05}
    assert recorded["temperature"]["source"].endswith("generation_config.json")
    llm = LLM(tiny_with_defaults)
    params = llm.engine.default_params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.2, 0.9, 40, None)
    # A request's own fields win; explicit SamplingParams are taken as given (as vLLM does).
    assert SamplingParams.from_defaults(manifest.sampling_defaults, temperature=0.0).temperature == 0.0


@pytest.mark.parametrize("quantization", ["w8a16", "w8a8"])
def test_a_checkpoint_quantized_at_export_keeps_its_generation_config(tiny_with_defaults: Path, tmp_path: Path,
                                                                      quantization: str) -> None:
    source = json.loads((tiny_with_defaults / "export_config.json").read_text())["model"]["source"]
    config = ExportConfig.model_validate({"model": {"source": source, "quantization": quantization}, "export": {
        "max_model_len": MAX_MODEL_LEN, "verify_gears": False,
        "buckets": {"decode_batch": [4], "prefill_tokens": [64], "prefill_max_seqs": 4}}})
    export(config, tmp_path / "artifact", log=io.StringIO())
    assert Manifest.load(tmp_path / "artifact").generation_defaults == Manifest.load(tiny_with_defaults).generation_defaults


def test_the_server_uses_the_artifacts_defaults_unless_the_deployment_sets_them(tiny_with_defaults: Path) -> None:
    def defaults(sampling: dict[str, float]) -> dict[str, object]:
        deployment = Deployment.model_validate({"model": {"artifact": str(tiny_with_defaults)}, "sampling": sampling,
                                                "kv_cache": {"num_blocks": 32}})
        frontend = build_app(deployment, "test").state.frontend
        frontend.loop.stop()
        return frontend.defaults

    assert (defaults({})["temperature"], defaults({})["top_p"]) == (0.2, 0.9)
    assert defaults({"temperature": 0.7})["temperature"] == 0.7


def test_the_bundled_models_deployment_ships_its_generation_config() -> None:
    from pagedgraph.runtime.deploy_config import load_deployment

    sampling = load_deployment(REPO / "configs" / "deploy-smollm2.yaml").sampling
    assert (sampling.temperature, sampling.top_p, sampling.max_tokens) == (0.2, 0.9, DEFAULT_MAX_TOKENS)


def test_max_tokens_one_policy_offline(tiny_with_defaults: Path) -> None:
    """Left out: DEFAULT_MAX_TOKENS capped to the context left. Too large: refused, never cut silently."""
    llm = LLM(tiny_with_defaults)
    prompt = list(range(3, 103))  # 100 tokens of a 128-token context
    capped, refused, fits = llm.generate([prompt] * 3, [SamplingParams(temperature=0, ignore_eos=True),
                                                        SamplingParams(max_tokens=29, temperature=0),
                                                        SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)])
    assert (len(capped.token_ids), capped.finish_reason) == (MAX_MODEL_LEN - 100, "length")
    assert refused.finish_reason == "error" and "max_tokens: 29" in refused.error and "at most 28" in refused.error
    assert len(fits.token_ids) == 28


def test_max_tokens_one_policy_cli(tiny_with_defaults: Path, tmp_path: Path) -> None:
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"prompt_token_ids": list(range(3, 103)), "ignore_eos": True},
        {"prompt_token_ids": list(range(3, 103)), "max_tokens": 29}]))
    assert main(["generate", "--artifact", str(tiny_with_defaults), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl"), "--temperature", "0"]) == 0
    capped, refused = (json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines())
    assert len(capped["token_ids"]) == MAX_MODEL_LEN - 100 and capped["finish_reason"] == "length"
    assert "max_tokens" in refused["error"]


CHI2_20_DOF_P001 = 45.31  # the chi-square quantile at p = 0.001 for 20 degrees of freedom


def test_temperature_1_first_tokens_follow_the_softmax_of_the_top20_logprobs(smollm2_artifact: Path) -> None:
    """2,000 first-token draws at T=1 (125 seeded requests x n=16 forks of one prefill each) against the
    distribution of the engine's own top-20 logprobs, the rest of the mass in one bin: 21 bins, 20 dof.

    The prompt is one where the model is as flat as the issue found it (top token p ~ 0.1, ~45% of the mass
    outside the top 20); 4 tokens, so 16 prompts fill the smallest prefill gear (T=64)."""
    llm = LLM(smollm2_artifact, num_blocks=128)
    prompt = "My favourite colour is"
    assert len(llm.engine.tokenizer.encode(prompt)) == 4
    reported = (0, 124)  # logprobs from the first and the last step (they cost a log-softmax per draw)
    params = [SamplingParams(max_tokens=1, temperature=1.0, top_p=1.0, top_k=0, n=16, seed=i,
                             logprobs=20 if i in reported else None) for i in range(125)]
    outputs = llm.generate([prompt] * len(params), params)
    draws = [c.token_ids[0] for out in outputs for c in out.outputs]
    assert len(draws) == 2000
    top = dict(sorted(outputs[0].outputs[0].logprobs[0].items(), key=lambda item: -item[1])[:20])
    for token, logp in outputs[reported[1]].outputs[0].logprobs[0].items():  # the same row, steps apart
        assert token not in top or math.isclose(logp, top[token], abs_tol=1e-4)
    expected = {t: len(draws) * math.exp(lp) for t, lp in top.items()}
    other_expected = len(draws) - sum(expected.values())
    counts = Counter(t if t in top else -1 for t in draws)
    observed = np.array([counts[t] for t in top] + [counts[-1]], float)
    wanted = np.array(list(expected.values()) + [other_expected])
    assert wanted.min() >= 5, wanted  # the chi-square approximation holds
    chi2 = float(((observed - wanted) ** 2 / wanted).sum())
    print(f"chi-square {chi2:.1f} on 20 dof (bound {CHI2_20_DOF_P001})")
    assert chi2 < CHI2_20_DOF_P001, (chi2, observed, wanted)
