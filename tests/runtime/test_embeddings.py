"""Embedding artifacts (export.task: embed) against HF transformers on tiny random Qwen3 and LLaMA checkpoints.

The engine's vectors must equal the pooled (last token, or mean), L2-normalised final hidden states of
transformers' base model (`model(...).last_hidden_state`, after the final norm) within 1e-4, whether each request
runs alone, batched with the others, in chunks of a block, after preemption or after a prefix hit; every request
frees its blocks. Also: Matryoshka `dimensions`, a checkpoint laid out as Qwen3-Embedding ships (base-model weights,
no LM head, sentence-transformers modules), the MINDIR graphs, and the refusals between the two tasks.
"""
from __future__ import annotations

import functools
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pagedgraph.artifact.settings import ConfigError
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export
from pagedgraph.cli import main
from pagedgraph.inspect import describe, text
from pagedgraph.runtime.engine import LLM, EngineConfig, LLMEngine, RequestOutput
from pagedgraph.runtime.pooling_params import PoolingParams
from pagedgraph.runtime.sampling_params import RequestError, SamplingParams
from tests.tiny_models import make_tiny_hf_checkpoint

pytestmark = pytest.mark.unit
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CHECKPOINTS = {"qwen3": dict(arch="qwen3", tie=False), "llama": dict(arch="llama", tie=True)}
POOLINGS = ("last", "mean")
MAX_MODEL_LEN = 128
# One token to the whole context (a prompt may fill max_model_len: nothing is generated after it).
PROMPTS = [[5, 17, 42], list(range(10, 60)), [7], list(range(100, 140, 3)), list(range(3, 120)),
           [(7 * i) % 290 + 3 for i in range(MAX_MODEL_LEN)]]
EXPORT = {"max_model_len": MAX_MODEL_LEN,
          "buckets": {"decode_batch": [1, 4], "prefill_tokens": [16, 64, 128], "prefill_max_seqs": 4}}
TOLERANCE, COSINE = 1e-4, 0.99999


def _export(source: Path, out: Path, **options: Any) -> Path:
    export(ExportConfig.model_validate({"model": {"source": str(source)}, "export": {**EXPORT, **options}}), out,
           log=io.StringIO())
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("embedding-checkpoints")
    return {name: make_tiny_hf_checkpoint(root / name, **case) for name, case in CHECKPOINTS.items()}


@pytest.fixture(scope="module")
def artifacts(checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("embedding-artifacts")
    return {(arch, pooling): _export(source, root / f"{arch}-{pooling}", task="embed", pooling={"type": pooling})
            for arch, source in checkpoints.items() for pooling in POOLINGS}


@functools.cache
def base_model(model_dir: Path) -> Any:
    return transformers.AutoModel.from_pretrained(model_dir, dtype=torch.float32)


def hidden_states(model_dir: Path, prompt: list[int]) -> np.ndarray:
    """transformers' base model (the final norm's output) on `prompt`, float64 [tokens, hidden]."""
    with torch.no_grad():
        return base_model(model_dir)(torch.tensor([prompt])).last_hidden_state[0].double().numpy()


def reference(model_dir: Path, prompts: list[list[int]], pooling: str, dimensions: int | None = None
              ) -> list[np.ndarray]:
    """Each prompt's pooled hidden state, cut to `dimensions`, L2-normalised: what vLLM's embedding pooler returns."""
    vectors = []
    for prompt in prompts:
        states = hidden_states(model_dir, prompt)
        vector = (states[-1] if pooling == "last" else states.mean(axis=0))[:dimensions]
        vectors.append(vector / np.linalg.norm(vector))
    return vectors


def run(engine: LLMEngine, prompts: list[list[int]], params: PoolingParams | None = None) -> list[RequestOutput]:
    """Every prompt through the engine together; the finished outputs in order."""
    ids = [engine.add_request(prompt, params).request_id for prompt in prompts]
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    return [done[i] for i in ids]


def assert_close(vectors: list[np.ndarray], expected: list[np.ndarray], label: str) -> None:
    for i, (got, want) in enumerate(zip(vectors, expected, strict=True)):
        assert got.dtype == np.float32 and got.shape == want.shape, label
        assert np.abs(got - want).max() <= TOLERANCE, f"{label}, prompt {i}: {np.abs(got - want).max()}"
        assert float(got @ want) / float(np.linalg.norm(got) * np.linalg.norm(want)) >= COSINE, f"{label}, prompt {i}"


def assert_all_blocks_free(engine: LLMEngine) -> None:
    state = engine.snapshot()
    assert (state.running, state.waiting) == (0, 0)
    assert state.kv_blocks_free == state.kv_blocks_total, "an embedding request kept blocks after it finished"


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("arch", CHECKPOINTS)
def test_embeddings_equal_transformers_alone_batched_and_chunked(arch: str, pooling: str, checkpoints: dict[str, Path],
                                                                 artifacts: dict[tuple[str, str], Path]) -> None:
    expected = reference(checkpoints[arch], PROMPTS, pooling)
    alone = LLMEngine(artifacts[arch, pooling], EngineConfig(num_blocks=64, enable_prefix_caching=False))
    runs = {"alone": [run(alone, [prompt])[0] for prompt in PROMPTS]}
    for label, budget in (("batched", 256), ("chunked in blocks of 16", 16)):
        engine = LLMEngine(artifacts[arch, pooling], EngineConfig(num_blocks=64, max_num_batched_tokens=budget))
        runs[label] = run(engine, PROMPTS)
        assert_all_blocks_free(engine)
    assert_all_blocks_free(alone)
    for label, outs in runs.items():
        assert all(out.finish_reason == "stop" and out.token_ids == [] and out.error is None for out in outs)
        assert_close([out.embedding for out in outs], expected, f"{arch} {pooling}, {label}")
        for out, solo in zip(outs, runs["alone"]):  # the batch and the chunking change nothing beyond rounding
            assert np.abs(out.embedding - solo.embedding).max() <= 1e-6, label


def test_last_pooling_reads_the_prefix_cache_and_mean_pooling_does_not(checkpoints: dict[str, Path],
                                                                        artifacts: dict[tuple[str, str], Path]) -> None:
    prompt = PROMPTS[4]  # 117 tokens: 7 full blocks
    for pooling, cached in (("last", 112), ("mean", 0)):
        engine = LLMEngine(artifacts["qwen3", pooling], EngineConfig(num_blocks=64))
        first, again = run(engine, [prompt]), run(engine, [prompt])
        assert (first[0].num_cached_tokens, again[0].num_cached_tokens) == (0, cached), pooling
        assert_close([again[0].embedding], [first[0].embedding], f"{pooling} after a prefix hit")
        assert_all_blocks_free(engine)  # cached blocks are free (evictable)


def test_preempted_mean_pooling_restarts_its_sum(checkpoints: dict[str, Path],
                                                 artifacts: dict[tuple[str, str], Path]) -> None:
    """Four prompts fed a block per step each, in a pool of 9 blocks for prompts of up to 8: sequences are
    preempted mid-prompt and recomputed from their first token, and the vectors are still transformers'."""
    engine = LLMEngine(artifacts["llama", "mean"], EngineConfig(num_blocks=10, max_num_batched_tokens=64,
                                                                 long_prefill_token_threshold=16))
    outs = run(engine, PROMPTS)
    assert engine.snapshot().preemptions > 0
    assert_close([out.embedding for out in outs], reference(checkpoints["llama"], PROMPTS, "mean"), "preempted")
    assert_all_blocks_free(engine)


def test_matryoshka_dimensions_cut_then_normalise(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    artifact = _export(checkpoints["qwen3"], tmp_path / "mrl", task="embed",
                       pooling={"type": "last", "matryoshka_dimensions": [16, 32]})
    engine = LLMEngine(artifact, EngineConfig(num_blocks=64))
    prompts = PROMPTS[:3]
    outs = run(engine, prompts, PoolingParams(dimensions=16))
    assert_close([out.embedding for out in outs], reference(checkpoints["qwen3"], prompts, "last", 16), "16 dims")
    assert run(engine, prompts[:1])[0].embedding.shape == (64,)
    with pytest.raises(RequestError, match="this model serves dimensions 16, 32") as refused:
        engine.add_request(prompts[0], PoolingParams(dimensions=8))
    assert refused.value.field == "dimensions"


def test_a_qwen3_embedding_layout_exports_with_its_own_pooling(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Base-model weights without the `model.` prefix and without an LM head under a config that names the causal
    class (as Qwen3-Embedding ships), with sentence-transformers modules asking for mean pooling and Normalize."""
    source = tmp_path / "st"
    transformers.AutoModel.from_pretrained(checkpoints["qwen3"], dtype=torch.float32).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (checkpoints["qwen3"] / name).is_file():
            shutil.copy(checkpoints["qwen3"] / name, source / name)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (source / "modules.json").write_text(json.dumps(modules))
    (source / "1_Pooling").mkdir()
    (source / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_lasttoken": False, "include_prompt": True}))
    artifact = _export(source, tmp_path / "art", task="embed")
    record = describe(artifact)
    assert record["task"] == "embed" and record["pooling"]["type"] == "mean" and record["pooling"]["normalize"]
    assert "task          embed (mean pooling, L2-normalised; not Matryoshka" in text(record)
    assert not any("lm_head" in name for name in json.loads((artifact / "manifest.json").read_text())["files"])
    outs = LLM(artifact, num_blocks=64).embed([PROMPTS[1], PROMPTS[3]])
    assert_close([out.embedding for out in outs], reference(source, [PROMPTS[1], PROMPTS[3]], "mean"), "st layout")


def test_the_mindir_graphs_pool_as_the_onnx_graph_does(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("mindspore", reason="MindSpore is not installed: pip install -e .[mindspore]")
    artifact = _export(checkpoints["qwen3"], tmp_path / "mindir", task="embed", pooling={"type": "mean"},
                       formats=["onnx", "mindir"], verify_gears=False, mindir_workers=1,
                       buckets={"decode_batch": [4], "prefill_tokens": [64], "prefill_max_seqs": 4,
                                "context_blocks": [8]})
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    vectors = {executor: [out.embedding for out in run(LLMEngine(artifact, EngineConfig(
        num_blocks=32, executor=executor, max_num_batched_tokens=64)), prompts)]
        for executor in ("onnxruntime", "mindspore")}
    assert_close(vectors["mindspore"], vectors["onnxruntime"], "mindspore")


def test_each_task_refuses_the_other(checkpoints: dict[str, Path], artifacts: dict[tuple[str, str], Path],
                                     tmp_path: Path) -> None:
    embedder = LLMEngine(artifacts["qwen3", "last"], EngineConfig(num_blocks=64))
    with pytest.raises(RequestError, match="exported for embeddings .* generates nothing") as refused:
        embedder.add_request(PROMPTS[0], SamplingParams(max_tokens=4))
    assert refused.value.field == "task"
    with pytest.raises(RequestError, match="max_model_len is 128, so prompts must be at most 128 tokens"):
        embedder.add_request(PROMPTS[-1] + [5])
    with pytest.raises(ValueError, match="export.task embed: use LLM.embed"):
        LLM(artifacts["qwen3", "last"], num_blocks=64).generate("hello")
    with pytest.raises(ValueError, match="speculative_config: .* exported for embeddings"):
        LLMEngine(artifacts["qwen3", "last"], EngineConfig(num_blocks=64, speculative_config={
            "method": "ngram", "num_speculative_tokens": 2}))

    generator = LLMEngine(_export(checkpoints["qwen3"], tmp_path / "generate"), EngineConfig(num_blocks=64))
    with pytest.raises(RequestError, match="exported for generation .* no pooling head") as refused:
        generator.add_request(PROMPTS[0], PoolingParams())
    assert refused.value.field == "task"
    with pytest.raises(RequestError, match="so prompts must be at most 127 tokens"):
        generator.add_request(PROMPTS[-1])


def test_the_cli_exports_an_embedding_model_and_generate_refuses_it(checkpoints: dict[str, Path], tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert main(["export", "--model", str(checkpoints["llama"]), "--pooling", "mean", "--out", str(out)]) == 0
    assert describe(out, verify=False)["pooling"]["type"] == "mean"
    assert main(["generate", "--artifact", str(out), "--prompt", "hi"]) == 2
    assert "was exported with export.task embed: use LLM.embed, or /v1/embeddings" in capsys.readouterr().err


@pytest.mark.parametrize("options, message", [
    ({"pooling": {"type": "mean"}}, "export.pooling sets \\['type'\\], but export.task is generate"),
    ({"task": "embed", "baseline": "naive"}, "an embedding export .* has none: remove export.baseline"),
    ({"task": "embed", "buckets": {"verify_tokens": [8]}}, "generates no tokens to verify"),
    ({"task": "embed", "pooling": {"matryoshka": False, "matryoshka_dimensions": [8]}}, "with matryoshka true"),
], ids=["pooling-without-embed", "baseline", "verify-tokens", "dimensions-without-matryoshka"])
def test_the_export_schema_refuses_what_an_embedding_export_cannot_be(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ExportConfig.model_validate({"export": options})


def test_a_generate_exports_recorded_config_reads_back() -> None:
    """A manifest's export_config lists every key, `export.pooling`'s null for a generate export: it validates again
    (as `pagedgraph plan --config` reads it)."""
    recorded = ExportConfig.model_validate({}).model_dump(mode="json")
    assert ExportConfig.model_validate(recorded).export.task == "generate"


def test_matryoshka_dimensions_past_the_hidden_size_are_refused(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the model's vectors have 64 dimensions"):
        _export(checkpoints["llama"], tmp_path / "wide", task="embed", pooling={"matryoshka_dimensions": [32, 128]})
