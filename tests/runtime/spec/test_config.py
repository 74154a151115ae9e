"""speculative_config with vLLM's keys, from YAML, `EngineConfig` and the CLI's JSON: errors name the key; the
export ladder gains the small verification gears."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from pagedgraph.artifact.settings import ConfigError
from pagedgraph.cli import _speculative_json
from pagedgraph.exporter.buckets import plan_gears
from pagedgraph.exporter.config import ExportOptions
from pagedgraph.graphs.contract import PREFILL
from pagedgraph.inspect import speculation
from pagedgraph.runtime.deploy_config import engine_config, load_deployment
from pagedgraph.runtime.engine import EngineConfig
from pagedgraph.runtime.spec.config import SpeculativeConfig
from tests.runtime.test_deploy_config import MODEL, _manifest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("given", "expected"), [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method = 'eagle'"),
    ({"method": "ngram"}, "num_speculative_tokens: Field required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens = 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead = 3: unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min = 4 exceeds prompt_lookup_max = 2"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft's artifact directory in `model`"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/a"}, "model = '/a': method ngram"),
])
def test_bad_keys_are_named(given: dict, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        EngineConfig(speculative_config=given)


def test_lookup_defaults_are_vllms() -> None:
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative_config
    assert isinstance(config, SpeculativeConfig) and config.lookup_range == (5, 5)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4).lookup_range == (4, 4)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2).lookup_range == (2, 2)


def test_the_cli_json_is_checked_before_anything_loads() -> None:
    with pytest.raises(ConfigError, match="--speculative-config: not JSON"):
        _speculative_json("{method: ngram}")
    assert _speculative_json('{"method": "ngram", "num_speculative_tokens": 2}') == {
        "method": "ngram", "num_speculative_tokens": 2}


def test_the_deployment_yaml_section_reaches_the_engine(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("model: {artifact: art}\nspeculative_config:\n  method: draft_model\n"
                    "  num_speculative_tokens: 3\n  model: drafts/q4\n")
    deployment = load_deployment(path)
    spec = engine_config(deployment, _manifest(), str(path)).speculative_config
    assert isinstance(spec, SpeculativeConfig)
    assert (spec.method, spec.num_speculative_tokens, spec.model) == ("draft_model", 3, str(tmp_path / "drafts/q4"))


def test_verify_tokens_join_the_prefill_ladder() -> None:
    options = ExportOptions.model_validate({"max_model_len": 256, "buckets": {
        "prefill_tokens": [64, 256], "prefill_max_seqs": 16, "verify_tokens": [8, 16, 32]}})
    gears = plan_gears(MODEL, options)[PREFILL]
    assert sorted({(g.tokens, g.seqs) for g in gears}) == [(8, 8), (16, 16), (32, 16), (64, 16), (256, 16)]
    with pytest.raises(ValueError, match="verify_tokens must be"):
        ExportOptions.model_validate({"buckets": {"verify_tokens": [16, 8]}})


def test_inspect_shows_the_speculation_gears() -> None:
    manifest = replace(_manifest(), export_config={"export": {"buckets": {"verify_tokens": [8, 16]}}})
    record = speculation(manifest)
    assert record["verify_tokens"] == [8, 16] and record["max_num_speculative_tokens"] == 15
    assert record["k_at_b1_in_smallest_gear"] == 63  # the manifest's smallest prefill gear is T=64
    assert record["k_at_b1_in_decode_gears"] == max(g.seqs for g in manifest.families["decode"].gears) - 1
