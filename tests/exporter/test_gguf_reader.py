"""GGUF reader: SmolLM2's config and tensors, rope un-permutation, and the errors users see."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from pagedgraph.exporter.checkpoint.base import Checkpoint, CheckpointError
from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path, read_gguf
from pagedgraph.graphs.models import FAMILIES
from tests.exporter.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.unit


def test_default_model_path_is_the_packaged_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_smollm2_config(smollm2_checkpoint: Checkpoint) -> None:
    c = smollm2_checkpoint.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert smollm2_checkpoint.tokenizer.eos_token_ids == (2,) and not smollm2_checkpoint.tokenizer.add_bos_token


def test_smollm2_tensors(smollm2_checkpoint: Checkpoint) -> None:
    t = smollm2_checkpoint.tensors
    assert len(t) == 2 + 30 * 9 and "lm_head.weight" not in t
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert t["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(a.dtype == np.float32 and a.flags.c_contiguous and np.isfinite(a).all() for a in t.values())


def test_rope_permutation_is_undone(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path)
    checkpoint = read_gguf(path)
    assert set(checkpoint.tensors) == set(expected)
    for name, weight in expected.items():
        np.testing.assert_array_equal(checkpoint.tensors[name], weight, err_msg=name)
    c = checkpoint.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (2, 4, 2, 4, 5)
    assert not c.tie_word_embeddings and c.rms_norm_eps == 1e-6 and c.eos_token_ids == (0,)


@pytest.mark.parametrize(
    ("variant", "field"),
    [
        ({"tokenizer_model": "llama"}, "tokenizer.ggml.model"),
        ({"tokenizer_pre": "llama-bpe"}, "tokenizer.ggml.pre"),
        ({"rope_scaling": "linear"}, "rope scaling"),
    ],
)
def test_unsupported_variants_are_refused(tmp_path: Path, variant: dict[str, str], field: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, **variant)
    with pytest.raises(CheckpointError) as info:
        read_gguf(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and field in message and "HF" in message


def test_unknown_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(CheckpointError) as info:
        read_gguf(path)
    message = str(info.value)
    assert str(path) in message and "'gpt2'" in message
    assert all(family in message for family in FAMILIES)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.gguf"
    with pytest.raises(CheckpointError) as info:
        read_gguf(path)
    assert str(info.value).startswith(f"GGUF file not found: {path}")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"this is not a gguf file at all")
    with pytest.raises(CheckpointError) as info:
        read_gguf(path)
    assert str(info.value).startswith(f"{path} is not a readable GGUF file")


def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError) as info:
        read_gguf(path)
    assert str(info.value).startswith(f"{path} is not a readable GGUF file: it is truncated or corrupt")
