"""The deployment YAML: schema errors name the field, CLI overrides win, the artifact check names the fix."""
from __future__ import annotations

from pathlib import Path

import pytest

from pagedgraph.artifact.manifest import Family, Manifest
from pagedgraph.artifact.settings import ConfigError
from pagedgraph.graphs.config import ModelConfig
from pagedgraph.graphs.contract import DECODE, PREFILL, Gear
from pagedgraph.cli import main
from pagedgraph.runtime.deploy_config import Deployment, engine_config, load_deployment
from pagedgraph.runtime.engine import EngineConfig
from tests.paths import REPO

pytestmark = pytest.mark.unit
MODEL = ModelConfig(architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=2, num_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=512, tie_word_embeddings=True)
BLOCKS = (4, 8, 16)


def _manifest(block_size: int = 16, max_model_len: int = 256) -> Manifest:
    """An artifact exported with decode_batch [1, 4, 16], prefill_tokens [64, 256], context_blocks [4, 8, 16]."""
    families = {PREFILL: Family("g.onnx", tuple(Gear(t, 16, m) for t in (64, 256) for m in BLOCKS)),
                DECODE: Family("g.onnx", tuple(Gear(b, b, m) for b in (1, 4, 16) for m in BLOCKS))}
    return Manifest(MODEL, block_size, max_model_len, "float32", families, {})


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


def _deployment(**sections: dict) -> Deployment:
    return Deployment.model_validate({"model": {"artifact": "/a/smol"}, **sections})


def test_the_example_deployment_loads_with_paths_relative_to_it() -> None:
    deployment = load_deployment(REPO / "configs" / "deploy-smollm2.yaml")
    assert deployment.model.artifact == str(REPO / "artifacts" / "smollm2-w8a8")
    assert deployment.model.export_config == str(REPO / "configs" / "smollm2-w8a8.yaml")
    assert deployment.kv_cache.dtype == "int8"
    assert deployment.model_name == "SmolLM2-135M-Instruct"
    assert deployment.server.host == "127.0.0.1"
    assert deployment.kv_cache.block_size == 16


def test_cli_flags_override_the_yaml(tmp_path: Path) -> None:
    path = _write(tmp_path, "model: {artifact: art}\nserver: {port: 8000, api_key: from-yaml}\n"
                            "executor: {custom_ops: on}\n")  # YAML 1.1 reads a bare on as true: taken as "on"
    assert load_deployment(path).executor.custom_ops == "on"
    deployment = load_deployment(path, {"model.artifact": "/elsewhere/art", "server.host": "0.0.0.0",
                                        "server.port": 9001, "kv_cache.num_blocks": 99, "server.api_key": "cli",
                                        "server.max_concurrent_requests": None, "executor.custom_ops": "off"})
    assert deployment.model.artifact == "/elsewhere/art"
    assert (deployment.server.host, deployment.server.port, deployment.server.api_key) == ("0.0.0.0", 9001, "cli")
    assert deployment.kv_cache.num_blocks == 99
    assert deployment.executor.custom_ops == "off"
    assert deployment.model_name == "art"
    assert load_deployment(path).model.artifact == str(tmp_path / "art")


@pytest.mark.parametrize("text, expected", [
    ("model: {artifact: a}\nserver: {prot: 80}\n", "server.prot = 80: unknown key"),
    ("model: {artifact: a}\nserver: {port: 70000}\n",
     "server.port = 70000: Input should be less than or equal to 65535"),
    ("model: {artifact: a}\nkv_cache: {num_blocks: 1}\n", "kv_cache.num_blocks = 1"),
    ("model: {artifact: a}\nsampling: {temperature: -1}\n",
     "sampling.temperature = -1: Value error, must be a finite number >= 0"),
    ("model: {artifact: a}\nbuckets: {decode_batch: [4, 1]}\n", "buckets.decode_batch = [4, 1]: Value error, must be"),
    ("model: {artifact: a}\nscheduler: {max_num_seqs: '8'}\n",
     "scheduler.max_num_seqs = '8': Input should be a valid integer"),
    ("server: {port: 80}\n", "model: Field required"),
    ("model: {artifact: a}\nexecutor: {custom_ops: maybe}\n",
     "executor.custom_ops = 'maybe': Input should be 'auto', 'on' or 'off'"),
])
def test_schema_errors_name_the_field_and_value(tmp_path: Path, text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_deployment(_write(tmp_path, text))
    assert expected in str(err.value)


def test_engine_config_serves_the_chosen_subset_of_gears() -> None:
    deployment = _deployment(buckets={"decode_batch": [1, 16], "prefill_tokens": [256]},
                             scheduler={"max_num_seqs": 8, "max_model_len": 200}, kv_cache={"num_blocks": 77},
                             executor={"threads": 3, "custom_ops": "off"})
    config = engine_config(deployment, _manifest(), "deploy.yaml")
    assert config.gears is not None
    assert sorted({g.seqs for g in config.gears[DECODE]}) == [1, 16]
    assert {g.tokens for g in config.gears[PREFILL]} == {256}
    assert {g.blocks for g in config.gears[PREFILL]} == set(BLOCKS)
    assert (config.num_blocks, config.max_num_seqs, config.max_model_len) == (77, 8, 200)
    assert (config.threads, config.custom_ops) == (3, "off")
    assert config.enable_prefix_caching


def test_engine_config_rejects_an_unknown_custom_ops_mode() -> None:
    with pytest.raises(ValueError, match="custom_ops = 'yes': choose one of auto, on, off"):
        EngineConfig(custom_ops="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("sections, expected", [
    ({"kv_cache": {"block_size": 32}},
     "kv_cache.block_size = 32: the artifact /a/smol was exported with block_size 16"),
    ({"buckets": {"decode_batch": [1, 8]}},
     "buckets.decode_batch = [1, 8]: [8] not exported; the artifact /a/smol has decode_batch [1, 4, 16]"),
    ({"buckets": {"prefill_tokens": [64, 512]}},
     "[512] not exported; the artifact /a/smol has prefill_tokens [64, 256]"),
    ({"scheduler": {"max_model_len": 512}},
     "scheduler.max_model_len = 512: the artifact /a/smol was exported for at most 256"),
    ({"buckets": {"context_blocks": [4, 8]}}, "max_model_len 256 needs 16 blocks per sequence; add 16"),
])
def test_a_deployment_the_artifact_cannot_serve_says_why(sections: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        engine_config(_deployment(**sections), _manifest(), "deploy.yaml")
    assert "invalid deployment in deploy.yaml" in str(err.value)
    assert expected in str(err.value)


def test_serve_without_an_artifact_or_export_config_fails_clearly(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    path = _write(tmp_path, "model: {artifact: missing}\n")
    assert main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"model.artifact: {tmp_path / 'missing'} does not exist" in err
    assert "model.export_config" in err


def test_serve_custom_ops_flag_overrides_the_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{}")  # serve only checks it exists before launching
    path = _write(tmp_path, "model: {artifact: art}\nexecutor: {custom_ops: auto}\n")
    launched: list[Deployment] = []
    monkeypatch.setattr("pagedgraph.runtime.server.launch.serve", lambda deployment, source: launched.append(deployment))
    assert main(["serve", "--config", str(path), "--custom-ops", "off"]) == 0
    assert launched[0].executor.custom_ops == "off"
