"""GGUF files of the families beyond LLaMA, as users get them: tiny transformers checkpoints converted by llama.cpp's
own convert_hf_to_gguf.py (scripts/llama_cpp_converter.py), read back as the HF directory reads, exported with their
blocks kept, and Qwen2's pre-tokenizer split (Qwen2.5 and Qwen3 GGUFs) against transformers' GGUF tokenizer."""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedgraph.exporter.checkpoint import read_checkpoint
from pagedgraph.exporter.checkpoint.base import Checkpoint
from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path
from pagedgraph.exporter.checkpoint.gguf_tokenizer import build_tokenizer
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import export
from pagedgraph.artifact.manifest import Manifest
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.sampling_params import SamplingParams
from scripts.llama_cpp_converter import ConverterMissing, convert
from tests.conftest import missing_toolchain
from tests.mindspore_support import RecordingExecutor
from tests.tiny_models import default_model_tokenizer, make_tiny_hf_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

TEXTS = ["Hello  world 123", "The   2 cats's  ", "émoji 🎉 ok\n\n x", "a\r\n\r\nb  12345 I'M", "  leading", "x\t\ty"]
PROMPTS = [[504, 3458, 282, 4649, 314], list(range(1000, 1040)), [7], list(range(2000, 2120, 7))]


@pytest.fixture(scope="module")
def qwen3_hf(tmp_path_factory: pytest.TempPathFactory, smollm2_checkpoint: Checkpoint) -> Path:
    """A tiny Qwen3 (head_dim 32 over hidden 64, tied) on SmolLM2's vocabulary, which the converter recognises."""
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("qwen3") / "hf", arch="qwen3", tie=True,
                                   dims={"head_dim": 32}, tokenizer=default_model_tokenizer(smollm2_checkpoint))


def _converted(hf: Path, outtype: str) -> Path:
    try:
        return convert(hf, hf.parent / f"{outtype}.gguf", outtype)
    except ConverterMissing as error:
        missing_toolchain("llama.cpp's convert_hf_to_gguf.py", error)


def test_qwen3_gguf_reads_as_its_hf_directory(qwen3_hf: Path) -> None:
    ours, theirs = read_checkpoint(qwen3_hf), read_checkpoint(_converted(qwen3_hf, "f32"))
    # the converter keeps the tokenizer's EOS only (generation_config.json's extra stop id is not in the file)
    assert theirs.config == dataclasses.replace(ours.config, eos_token_ids=theirs.config.eos_token_ids)
    assert set(theirs.tensors) == set(ours.tensors)
    for name in ours.tensors:  # q/k stay as HF lays them: llama.cpp permutes rope rows for LLaMA only
        np.testing.assert_array_equal(theirs.tensors[name], ours.tensors[name], err_msg=name)
    assert [_tokenizer(theirs).encode(t).ids for t in TEXTS] == [_tokenizer(ours).encode(t).ids for t in TEXTS]


def _tokenizer(checkpoint: object) -> object:
    from tokenizers import Tokenizer

    return Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)  # type: ignore[attr-defined]


def _prefill_logits(artifact: Path) -> list[np.ndarray]:
    engine = LLMEngine(artifact, EngineConfig(num_blocks=64, max_num_batched_tokens=256))
    recorder = engine.runner.executor = RecordingExecutor(engine.runner.executor)
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return [logits for _, logits in recorder.steps]


def _export(source: Path, out: Path, quantization: str = "none") -> Path:
    config = ExportConfig.model_validate({"model": {"source": str(source), "quantization": quantization}, "export": {
        "max_model_len": 256, "verify_gears": False,
        "buckets": {"decode_batch": [4], "prefill_tokens": [256], "prefill_max_seqs": 4}}})
    export(config, out, log=io.StringIO())
    return out


def test_qwen3_gguf_blocks_are_kept_and_track_the_float_model(qwen3_hf: Path) -> None:
    """Q8_0 as llama.cpp writes it, served on its own blocks: within int8 noise of the float checkpoint's logits (a
    swapped or mis-scaled block gives errors the size of the logits)."""
    float_logits = _prefill_logits(_export(qwen3_hf, qwen3_hf.parent / "float"))
    artifact = _export(_converted(qwen3_hf, "q8_0"), qwen3_hf.parent / "q8_0", quantization="gguf")
    assert Manifest.load(artifact).weight_formats.get("Q8_0", 0) >= 2 * 7  # every linear of both layers
    for got, want in zip(_prefill_logits(artifact), float_logits):
        assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()


def test_qwen2_pre_tokenizer_split_equals_transformers(tmp_path: Path) -> None:
    """SmolLM2's vocabulary under `tokenizer.ggml.pre = qwen2`: transformers' GGUF tokenizer is the reference."""
    reader = gguf.GGUFReader(default_model_path())
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.ggml.")}
    writer = gguf.GGUFWriter(tmp_path / "qwen2-tokenizer.gguf", "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(metadata["tokenizer.ggml.tokens"])
    writer.add_token_merges(metadata["tokenizer.ggml.merges"])
    writer.add_token_types(metadata["tokenizer.ggml.token_type"])
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2)):
        writer.add_uint32(f"qwen2.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="qwen2-tokenizer.gguf")
    ours = build_tokenizer({**metadata, "tokenizer.ggml.pre": "qwen2"}, "qwen2-tokenizer.gguf")
    gpt2_split = build_tokenizer({**metadata, "tokenizer.ggml.pre": "gpt-2"}, "gpt2")
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text, add_special_tokens=False)
    assert any(ours.encode(t).ids != gpt2_split.encode(t).ids for t in TEXTS)  # the split is really Qwen2's
