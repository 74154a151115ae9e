"""A tiny random Llama checkpoint written with numpy alone (no torch), for lowering tests."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from tests.tiny_models import BOS, BOS_ID, EOS, EOS_ID, TINY_DIMS, make_tiny_tokenizer


def _tensor_shapes(d: dict[str, int]) -> dict[str, tuple[int, ...]]:
    hidden, inter = d["hidden_size"], d["intermediate_size"]
    kv = d["num_key_value_heads"] * hidden // d["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (d["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    layer = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, hidden),
             "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter)}
    for i in range(d["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def write_random_llama(out: Path, seed: int = 0, dims: dict[str, int] = TINY_DIMS) -> Path:
    """A Llama of `dims` (default TINY_DIMS: GQA, tied embeddings) with random weights and norms, plus tokenizer
    files (the tokenizer's vocabulary stays TINY_DIMS')."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in _tensor_shapes(dims).items():
        scale = 0.1 if len(shape) == 1 else 0.2
        tensors[name] = ((1.0 if len(shape) == 1 else 0.0) + scale * rng.standard_normal(shape)).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "tie_word_embeddings": True,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "bos_token_id": BOS_ID,
              "eos_token_id": EOS_ID, **dims}
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_text(make_tiny_tokenizer().to_str())
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": EOS}))
    return out
