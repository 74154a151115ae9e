"""Greedy output does not depend on what else runs: every shipped precision and KV-cache dtype, on the real model,
and a Mixture-of-Experts model (a tiny random Qwen3-MoE: the rows each expert receives change with the batch).

One prompt alone, then inside batches of 2, 7 and 16 other prompts (it comes last, so the step budget chunks it
at other places), then after part of it and all of it are cached: its tokens and their logprobs are the same
every time, bit for bit. Logprobs make the check strict: a difference in the last float bit shows here long before
it flips a greedy token (docs/performance.md, "Batch invariance", found the sources op by op with
scripts/batch_invariance.py). The prompt is 49 tokens, one past a block boundary, so a full prefix hit leaves one
token to compute: the scheduler must recompute a block with it (runtime/scheduler.py). With n-gram speculation on,
a prompt that repeats itself gets its plain run's tokens and logprobs too, alone and beside others, drafts kept and
drafts rejected (runtime/model_runner.py verifies drafts as decode rows).
"""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from pagedgraph.runtime.engine import LLM, RequestOutput
from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.texts import shipped_text
from tests.conftest import TEST_EXPORT, short_calibration

pytestmark = pytest.mark.e2e
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
# Precision -> (the fixture of its artifact, the KV-cache dtype checked): the real model's are tests/conftest.py's
# session exports; exported here: a tiny random Qwen3 (per-head q/k norms) on SmolLM2's vocabulary at W8A8 with an
# int8 cache, and a tiny random Qwen3-MoE in float32 and w4a16.
CASES = [("fp32", "smollm2_kv_dtypes_artifact", "float32"), ("fp32", "smollm2_kv_dtypes_artifact", "bfloat16"),
         ("fp32", "smollm2_kv_dtypes_artifact", "int8"), ("bf16", "smollm2_bf16_artifact", "bfloat16"),
         ("w8a8", "smollm2_w8a8_artifact", "float32"), ("w8a8", "smollm2_w8a8_artifact", "int8"),
         ("w8a16", "smollm2_w8a16_artifact", "float32"), ("w4a16", "smollm2_w4a16_artifact", "float32"),
         ("gguf", "smollm2_gguf_artifact", "float32"), ("gguf-int8", "smollm2_gguf_int8_artifact", "float32"),
         ("qwen3-w8a8", "qwen3_w8a8_artifact", "int8"), ("moe-fp32", "moe_fp32_artifact", "float32"),
         ("moe-w4a16", "moe_w4a16_artifact", "float32")]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def _export(root: Path, model: dict, export: dict) -> Path:
    """A tiny model exported with the session artifacts' ladders (no baseline graph)."""
    from pagedgraph.exporter.config import ExportConfig
    from pagedgraph.exporter.export import export as run_export

    options = {**TEST_EXPORT["export"], "baseline": None, **export}
    run_export(ExportConfig.model_validate({"model": model, "export": options}), root / "artifact", log=io.StringIO())
    return root / "artifact"


@pytest.fixture(scope="module")
def qwen3_w8a8_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import default_model_tokenizer, make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("qwen3-w8a8")
    hf = make_tiny_hf_checkpoint(root / "hf", arch="qwen3", tie=True, tokenizer=default_model_tokenizer(),
                                 dims={"head_dim": 32, "max_position_embeddings": 2048})
    return _export(root, {"source": str(hf), "quantization": "w8a8"},
                   {"kv_cache_dtypes": ["float32", "int8"], **short_calibration(root)})


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 experts, top-4, beside a dense layer; positions for the longest prompt and its tokens."""
    from tests.graphs.test_tiny_models_vs_transformers import QWEN3_MOE
    from tests.tiny_models import make_tiny_hf_checkpoint

    pytest.importorskip("torch")
    dims = QWEN3_MOE | {"num_experts": 16, "num_experts_per_tok": 4, "mlp_only_layers": [1],
                        "max_position_embeddings": TEST_EXPORT["export"]["max_model_len"]}
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("moe-hf") / "hf", arch="qwen3_moe", tie=False, dims=dims)


@pytest.fixture(scope="module")
def moe_fp32_artifact(tmp_path_factory: pytest.TempPathFactory, moe_checkpoint: Path) -> Path:
    return _export(tmp_path_factory.mktemp("moe-fp32"), {"source": str(moe_checkpoint)}, {})


@pytest.fixture(scope="module")
def moe_w4a16_artifact(tmp_path_factory: pytest.TempPathFactory, moe_checkpoint: Path) -> Path:
    return _export(tmp_path_factory.mktemp("moe-w4a16"),
                   {"source": str(moe_checkpoint), "quantization": "w4a16", "group_size": 32}, {})


def _prompts(llm: LLM) -> tuple[list[int], list[list[int]]]:
    """The prompt under test (49 tokens) and 16 others of 20 to 110 tokens."""
    ids = llm.engine.tokenizer.encode(shipped_text("heldout"))
    others = [ids[600 + 130 * i:600 + 130 * i + 20 + (i * 37) % 91] for i in range(16)]
    return ids[:49], others


def _result(out: RequestOutput) -> tuple[list[int], list[dict[int, float]]]:
    assert out.error is None, out.error
    return out.token_ids, out.logprobs


def _config(kv_cache_dtype: str) -> dict:
    """A small step budget chunks the prompt differently in each batch; threads as CI has them."""
    return dict(kv_cache_dtype=kv_cache_dtype, num_blocks=256, max_num_batched_tokens=256, threads=2, custom_ops="on")


def _plain(fixture: str, kv_cache_dtype: str, request: pytest.FixtureRequest) -> tuple[Path, dict, LLM]:
    """The case's artifact, engine settings, and an engine without prefix caching."""
    artifact = request.getfixturevalue(fixture)
    config = _config(kv_cache_dtype)
    return artifact, config, LLM(artifact, enable_prefix_caching=False, **config)


IDS = [f"{p}-{kv}" for p, _, kv in CASES]


@pytest.mark.parametrize("precision,fixture,kv_cache_dtype", CASES, ids=IDS)
def test_a_prompt_gets_its_solo_tokens_in_any_batch_chunking_and_prefix_hit(
        precision: str, fixture: str, kv_cache_dtype: str, request: pytest.FixtureRequest) -> None:
    artifact, config, llm = _plain(fixture, kv_cache_dtype, request)
    target, others = _prompts(llm)
    solo = _result(llm.generate([target], GREEDY)[0])
    for n in (2, 7, 16):
        assert _result(llm.generate(others[:n] + [target], GREEDY)[-1]) == solo, f"inside a batch of {n} others"
    cached = LLM(artifact, enable_prefix_caching=True, **config)
    cached.generate([target[:35]], GREEDY)  # caches the prompt's first two blocks
    for hit in (32, 32):  # the second run hits three blocks but must recompute the third with the last token
        out = cached.generate([target], GREEDY)[0]
        assert _result(out) == solo and out.num_cached_tokens == hit, f"after a prefix hit of {out.num_cached_tokens}"


@pytest.mark.parametrize("precision,fixture,kv_cache_dtype", CASES, ids=IDS)
def test_speculation_gets_the_plain_runs_tokens_and_logprobs(
        precision: str, fixture: str, kv_cache_dtype: str, request: pytest.FixtureRequest) -> None:
    artifact, config, plain = _plain(fixture, kv_cache_dtype, request)
    target, others = _prompts(plain)
    target = target * 2  # its second half invites drafts from the first
    solo = _result(plain.generate([target], GREEDY)[0])
    spec = LLM(artifact, enable_prefix_caching=False, speculative_config=NGRAM, **config)
    for n in (0, 2):
        assert _result(spec.generate(others[:n] + [target], GREEDY)[-1]) == solo, f"speculating beside {n} others"
    stats = spec.engine.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, "drafts must be both kept and rejected here"
