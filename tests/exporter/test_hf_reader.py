"""The HF directory reader against transformers' own view of tiny random checkpoints."""
from __future__ import annotations

import json
import shutil
import sys
import types
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from pagedgraph.exporter.checkpoint import read_checkpoint
from pagedgraph.exporter.checkpoint.base import CheckpointError
from pagedgraph.exporter.checkpoint.hf_reader import read_hf_dir
from pagedgraph.graphs.config import RopeScaling
from tests.tiny_models import BOS_ID, CHAT_TEMPLATE, EOS_ID, EOT_ID, TINY_DIMS, make_tiny_hf_checkpoint

pytestmark = pytest.mark.unit
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama_tied": {"arch": "llama", "tie": True},
    "llama_untied_sharded": {"arch": "llama", "tie": False, "shard": True},
    "llama3_rope": {"arch": "llama", "tie": True, "rope_scaling": LLAMA3_ROPE},
    "llama_fp16": {"arch": "llama", "tie": True, "dtype": "float16"},
    "mistral": {"arch": "mistral", "tie": False},
    "qwen2_bf16": {"arch": "qwen2", "tie": False, "dtype": "bfloat16"},
}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Build each variant once per module, on first use."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = make_tiny_hf_checkpoint(tmp_path_factory.mktemp(name), **VARIANTS[name])
        return built[name]

    return get


@pytest.fixture
def copy_of(checkpoint_dir: Callable[[str], Path], tmp_path: Path) -> Callable[[str], Path]:
    """A private copy of a variant that a test may break."""
    return lambda name: Path(shutil.copytree(checkpoint_dir(name), tmp_path / name))


def _edit_json(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_tensor_equals_transformers_state_dict(checkpoint_dir: Callable[[str], Path], name: str) -> None:
    import transformers

    path = checkpoint_dir(name)
    ckpt = read_hf_dir(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    tied = VARIANTS[name]["tie"]
    assert set(ckpt.tensors) == set(state) - ({"lm_head.weight"} if tied else set())
    for key, tensor in ckpt.tensors.items():
        assert tensor.dtype == np.float32, key
        np.testing.assert_array_equal(tensor, state[key], err_msg=key)  # widening is exact


@pytest.mark.parametrize(
    ("name", "arch", "tied", "bias"),
    [
        ("llama_tied", "llama", True, False),
        ("llama_untied_sharded", "llama", False, False),
        ("mistral", "mistral", False, False),
        ("qwen2_bf16", "qwen2", False, True),
    ],
)
def test_config_fields(checkpoint_dir: Callable[[str], Path], name: str, arch: str, tied: bool, bias: bool) -> None:
    config = read_hf_dir(checkpoint_dir(name)).config
    assert config.architecture == arch
    assert config.vocab_size == TINY_DIMS["vocab_size"]
    assert config.hidden_size == TINY_DIMS["hidden_size"]
    assert config.intermediate_size == TINY_DIMS["intermediate_size"]
    assert config.num_layers == TINY_DIMS["num_hidden_layers"]
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.max_position_embeddings == TINY_DIMS["max_position_embeddings"]
    assert config.rms_norm_eps == 1e-6
    assert config.rope_theta == 10000.0
    assert config.rope_scaling is None
    assert config.tie_word_embeddings is tied
    assert config.attention_bias is bias
    assert config.bos_token_id == BOS_ID
    assert config.eos_token_ids == (EOS_ID, EOT_ID)


def test_llama3_rope_scaling(checkpoint_dir: Callable[[str], Path]) -> None:
    config = read_hf_dir(checkpoint_dir("llama3_rope")).config
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )


def test_qwen2_has_qkv_bias_and_bf16_file(checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir("qwen2_bf16")
    with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    tensors = read_hf_dir(path).tensors
    for proj, size in (("q", 64), ("k", 32), ("v", 32)):
        bias = tensors[f"model.layers.1.self_attn.{proj}_proj.bias"]
        assert bias.shape == (size,) and np.any(bias != 0)
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors


def test_sharded_checkpoint_reads_all_shards(checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir("llama_untied_sharded")
    assert len(list(path.glob("model-*.safetensors"))) > 2
    assert "lm_head.weight" in read_hf_dir(path).tensors


def test_tied_checkpoint_drops_stored_lm_head(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("llama_tied")
    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    save_file(tensors, path / "model.safetensors")
    ckpt = read_hf_dir(path)
    assert "lm_head.weight" not in ckpt.tensors
    assert not any("rotary_emb" in name for name in ckpt.tensors)


def test_tokenizer_spec(checkpoint_dir: Callable[[str], Path]) -> None:
    path = checkpoint_dir("llama_tied")
    spec = read_hf_dir(path).tokenizer
    assert spec.tokenizer_json == (path / "tokenizer.json").read_text()
    assert spec.chat_template == CHAT_TEMPLATE  # transformers 5 saves it as chat_template.jinja
    assert spec.bos_token_id == BOS_ID
    assert spec.eos_token_ids == (EOS_ID, EOT_ID)  # generation_config's list
    assert spec.add_bos_token is True  # not in tokenizer_config: read off the post-processor
    assert Tokenizer.from_str(spec.tokenizer_json).encode("hello").ids[0] == BOS_ID


def test_transformers4_layout(copy_of: Callable[[str], Path]) -> None:
    """Older saves: rope_theta + rope_scaling["type"], template and flags in tokenizer_config.json."""
    path = copy_of("llama3_rope")

    def old_config(c: dict[str, Any]) -> None:
        params = c.pop("rope_parameters")
        c["rope_theta"] = params.pop("rope_theta")
        c["rope_scaling"] = {"type": params.pop("rope_type"), **params}
        del c["head_dim"]

    def old_tokenizer_config(c: dict[str, Any]) -> None:
        c["chat_template"] = "{{ messages[0]['content'] }}"
        c["add_bos_token"] = False
        c["eos_token"] = {"content": "<|eot|>", "lstrip": False, "special": True}

    _edit_json(path / "config.json", old_config)
    _edit_json(path / "tokenizer_config.json", old_tokenizer_config)
    _edit_json(path / "generation_config.json", lambda c: c.update(eos_token_id=EOS_ID))
    (path / "chat_template.jinja").unlink()
    ckpt = read_hf_dir(path)
    assert ckpt.config.rope_theta == 500000.0
    assert ckpt.config.rope_scaling is not None and ckpt.config.rope_scaling.factor == 8.0
    assert ckpt.config.head_dim == 16
    assert ckpt.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert ckpt.tokenizer.add_bos_token is False
    assert ckpt.tokenizer.eos_token_ids == (EOS_ID, EOT_ID)


def test_qwen2_disabled_sliding_window_is_fine(copy_of: Callable[[str], Path]) -> None:
    path = copy_of("qwen2_bf16")
    _edit_json(path / "config.json", lambda c: c.update(sliding_window=32, use_sliding_window=False))
    assert read_hf_dir(path).config.architecture == "qwen2"


def _drop_tensor(path: Path) -> None:
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")


def _add_tensor(path: Path) -> None:
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = np.ones(16, np.float32)
    save_file(tensors, path / "model.safetensors")


def _truncate(path: Path) -> None:
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])


def _only_bin_weights(path: Path) -> None:
    (path / "model.safetensors").rename(path / "pytorch_model.bin")


def _config(**changes: Any) -> Callable[[Path], None]:
    return lambda path: _edit_json(path / "config.json", lambda c: c.update(changes))


ERROR_CASES: list[tuple[str, str, Callable[[Path], None], list[str]]] = [
    ("missing_config", "llama_tied", lambda p: (p / "config.json").unlink(), ["config.json", "not found"]),
    (
        "unknown_architecture",
        "llama_tied",
        _config(architectures=["GPT2LMHeadModel"]),
        ["GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
         "Qwen3MoeForCausalLM", "MixtralForCausalLM", "registered families: llama"],
    ),
    ("missing_field", "llama_tied", _config(hidden_size=None), ["'hidden_size'"]),
    ("missing_tensor", "llama_tied", _drop_tensor, ["model.layers.1.mlp.up_proj.weight", "missing"]),
    ("unexpected_tensor", "llama_tied", _add_tensor, ["model.layers.0.self_attn.q_norm.weight", "unexpected"]),
    ("corrupt_safetensors", "llama_tied", _truncate, ["model.safetensors", "re-download"]),
    ("shape_mismatch", "llama_tied", _config(intermediate_size=96), ["mlp.down_proj.weight", "[64, 128]", "[64, 96]"]),
    ("no_safetensors", "llama_tied", _only_bin_weights, ["pytorch_model.bin", "convert to safetensors"]),
    (
        "missing_shard",
        "llama_untied_sharded",
        lambda p: sorted(p.glob("model-*.safetensors"))[1].unlink(),
        ["model-00002-of-", "download all shards"],
    ),
    ("missing_tokenizer", "llama_tied", lambda p: (p / "tokenizer.json").unlink(), ["tokenizer.json", "not found"]),
    (
        "unknown_bos_token",
        "llama_tied",
        lambda p: _edit_json(p / "tokenizer_config.json", lambda c: c.update(bos_token="<bos>")),
        ["bos_token", "'<bos>'", "tokenizer_config.json"],
    ),
    (
        "yarn_rope",
        "llama_tied",
        _config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
        ["'yarn'", "not supported"],
    ),
    ("mistral_sliding_window", "mistral", _config(sliding_window=64), ["sliding_window=64", "not supported"]),
    (
        "qwen2_sliding_window",
        "qwen2_bf16",
        _config(sliding_window=64, use_sliding_window=True),
        ["sliding_window=64", "not supported"],
    ),
    ("quantized", "llama_tied", _config(quantization_config={"quant_method": "bitsandbytes"}),
     ["quantization_config.quant_method = 'bitsandbytes'", "gptq, awq"]),
]


@pytest.mark.parametrize(("case", "variant", "breaker", "phrases"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_error_messages(
    copy_of: Callable[[str], Path], case: str, variant: str, breaker: Callable[[Path], None], phrases: list[str]
) -> None:
    path = copy_of(variant)
    breaker(path)
    with pytest.raises(CheckpointError) as info:
        read_hf_dir(path)
    for phrase in phrases:
        assert phrase in str(info.value), (case, str(info.value))


def test_read_checkpoint_reads_directory(checkpoint_dir: Callable[[str], Path]) -> None:
    assert read_checkpoint(checkpoint_dir("llama_tied")).config.architecture == "llama"


def test_read_checkpoint_dispatches_gguf_and_rejects_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    fake = types.ModuleType("pagedgraph.exporter.checkpoint.gguf_reader")
    fake.read_gguf = lambda p, keep_blocks, pooling: ("gguf", p, keep_blocks, pooling)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pagedgraph.exporter.checkpoint.gguf_reader", fake)
    assert read_checkpoint(gguf) == ("gguf", gguf, False, None)
    assert read_checkpoint(gguf, keep_blocks=True) == ("gguf", gguf, True, None)

    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(CheckpointError, match="neither a directory nor a .gguf file"):
        read_checkpoint(other)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nope")
