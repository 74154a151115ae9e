"""GGUF reader: SmolLM2's config and tensors, rope un-permutation, and the errors users see."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from exporter.checkpoint.base import Checkpoint, CheckpointError
from exporter.checkpoint.gguf_reader import default_model_path, read_gguf
from graphs.config import SUPPORTED_ARCHITECTURES


@pytest.fixture(scope="module")
def smollm2() -> Checkpoint:
    return read_gguf(default_model_path())


def test_default_model_path_is_the_packaged_gguf() -> None:
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()


def test_smollm2_config(smollm2: Checkpoint) -> None:
    c = smollm2.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert smollm2.tokenizer.eos_token_ids == (2,) and not smollm2.tokenizer.add_bos_token


def test_smollm2_tensors(smollm2: Checkpoint) -> None:
    t = smollm2.tensors
    assert len(t) == 2 + 30 * 9 and "lm_head.weight" not in t
    assert t["model.embed_tokens.weight"].shape == (49152, 576)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert t["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    assert all(a.dtype == np.float32 and a.flags.c_contiguous and np.isfinite(a).all() for a in t.values())


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permute: HF rotate-half rows -> llama.cpp interleaved rope pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(
    path: Path, *, tokenizer_model: str = "gpt2", tokenizer_pre: str = "gpt-2", rope_scaling: str | None = None
) -> dict[str, np.ndarray]:
    """A 2-layer GQA LLaMA as llama.cpp would convert it (F32, untied); returns the HF-layout tensors."""
    arch = "llama"
    layers, hidden, heads, kv_heads, ffn = 2, 16, 4, 2, 24
    head_dim = hidden // heads
    tokens = ["<|endoftext|>", "a", "b", "ab", "Ġ"]
    rng = np.random.default_rng(0)
    hf = {
        "model.embed_tokens.weight": rng.standard_normal((len(tokens), hidden)),
        "model.norm.weight": rng.standard_normal(hidden),
        "lm_head.weight": rng.standard_normal((len(tokens), hidden)),
    }
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (("block_count", layers), ("context_length", 128), ("embedding_length", hidden),
                       ("feed_forward_length", ffn), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("rope.dimension_count", head_dim)):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    if rope_scaling is not None:
        writer.add_string(f"{arch}.rope.scaling.type", rope_scaling)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(["a b"])
    writer.add_token_types([3, 1, 1, 1, 1])
    writer.add_eos_token_id(0)
    for gguf_name, hf_name in (("token_embd", "model.embed_tokens"), ("output_norm", "model.norm"), ("output", "lm_head")):
        writer.add_tensor(f"{gguf_name}.weight", hf[f"{hf_name}.weight"].astype(np.float32))
    shapes = {"attn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden), "ffn_norm": (hidden,),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for layer in range(layers):
        for part, shape in shapes.items():
            weight = rng.standard_normal(shape)
            hf[f"model.layers.{layer}.{names[part]}.weight"] = weight
            if part in ("attn_q", "attn_k"):
                weight = _llama_cpp_permute(weight, heads if part == "attn_q" else kv_heads)
            writer.add_tensor(f"blk.{layer}.{part}.weight", weight.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {k: v.astype(np.float32) for k, v in hf.items()}


def test_rope_permutation_is_undone(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny_gguf(path)
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
    _write_tiny_gguf(path, **variant)
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
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


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
    _write_tiny_gguf(path)
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError) as info:
        read_gguf(path)
    assert str(info.value).startswith(f"{path} is not a readable GGUF file: it is truncated or corrupt")
