"""A tiny LLaMA written as llama.cpp's converter would (rope rows permuted), optionally block-quantized."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import gguf
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's permute: HF rotate-half rows -> llama.cpp interleaved rope pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path, *, tokenizer_model: str = "gpt2", tokenizer_pre: str = "gpt-2", rope_scaling: str | None = None,
    hidden: int = 16, ffn: int = 24, quant: Mapping[str, GGMLQuantizationType] | None = None,
) -> dict[str, np.ndarray]:
    """A 2-layer GQA LLaMA (untied); returns the HF-layout float32 tensors the file holds.

    `quant` maps GGUF tensor kinds ("token_embd", "attn_q", "ffn_down", ...) to a quantization type; such
    tensors are written with `gguf.quants.quantize` and returned as `gguf.quants.dequantize` reads them.
    """
    arch = "llama"
    layers, heads, kv_heads = 2, 4, 2
    head_dim = hidden // heads
    quant = quant or {}
    tokens = ["<|endoftext|>", "a", "b", "ab", "Ġ"]
    rng = np.random.default_rng(0)
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
    hf: dict[str, np.ndarray] = {}

    def add(kind: str, gguf_name: str, hf_name: str, hf_weight: np.ndarray, n_head: int | None = None) -> None:
        stored = hf_weight.astype(np.float32)
        if n_head is not None:
            stored = llama_cpp_permute(stored, n_head)
        qtype = quant.get(kind)
        if qtype is None:
            writer.add_tensor(gguf_name, stored)
            held = stored
        else:
            raw = quantize(stored, qtype)
            writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
            held = dequantize(raw, qtype).reshape(stored.shape)
        hf[hf_name] = unpermute(held, n_head) if n_head is not None else held

    add("token_embd", "token_embd.weight", "model.embed_tokens.weight", rng.standard_normal((len(tokens), hidden)))
    add("output_norm", "output_norm.weight", "model.norm.weight", rng.standard_normal(hidden))
    add("output", "output.weight", "lm_head.weight", rng.standard_normal((len(tokens), hidden)))
    shapes = {"attn_norm": (hidden,), "attn_q": (hidden, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden), "ffn_norm": (hidden,),
              "ffn_gate": (ffn, hidden), "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    names = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for layer in range(layers):
        for part, shape in shapes.items():
            n_head = heads if part == "attn_q" else kv_heads if part == "attn_k" else None
            add(part, f"blk.{layer}.{part}.weight", f"model.layers.{layer}.{names[part]}.weight",
                rng.standard_normal(shape), n_head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def write_qwen3_moe_gguf(hf_dir: Path, path: Path, expert_type: GGMLQuantizationType,
                         router_type: GGMLQuantizationType | None = None) -> dict[str, np.ndarray]:
    """The tiny Qwen3-MoE checkpoint in `hf_dir` (tests/tiny_models.py, experts one tensor each) written as llama.cpp's
    converter writes a `qwen3moe` GGUF: each layer's experts stacked into ffn_{gate,up,down}_exps ([E, rows, in]) in
    `expert_type` blocks, the routers in `router_type` blocks (float32 as the converter keeps them when None),
    everything else float32, the BPE tokenizer's vocabulary and merges. Returns the HF tensors as the file holds them
    (`gguf.quants.dequantize`'s values), to load into the HF model."""
    import json

    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    arch, layers = "qwen3moe", config["num_hidden_layers"]
    experts = config.get("num_experts", config.get("num_local_experts"))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (("block_count", layers), ("context_length", config["max_position_embeddings"]),
                       ("embedding_length", config["hidden_size"]), ("feed_forward_length", config["intermediate_size"]),
                       ("attention.head_count", config["num_attention_heads"]),
                       ("attention.head_count_kv", config["num_key_value_heads"]),
                       ("attention.key_length", head_dim), ("attention.value_length", head_dim),
                       ("expert_count", experts), ("expert_used_count", config["num_experts_per_tok"]),
                       ("expert_feed_forward_length", config["moe_intermediate_size"])):
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", config["rms_norm_eps"])
    writer.add_float32(f"{arch}.rope.freq_base", config["rope_parameters"]["rope_theta"])
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda item: item[1])
    special = {t["id"] for t in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]])
    writer.add_token_types([3 if i in special else 1 for _, i in vocab])
    writer.add_eos_token_id(config["eos_token_id"])
    held: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, qtype: GGMLQuantizationType | None = None) -> None:
        values = tensors[hf_name].astype(np.float32)
        if qtype is None:
            writer.add_tensor(gguf_name, values)
            held[hf_name] = values
            return
        raw = quantize(values, qtype)
        writer.add_tensor(gguf_name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        held[hf_name] = dequantize(raw, qtype).reshape(values.shape)

    add("token_embd.weight", "model.embed_tokens.weight")
    add("output_norm.weight", "model.norm.weight")
    if "lm_head.weight" in tensors:
        add("output.weight", "lm_head.weight")
    own = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
           "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}
    for layer in range(layers):
        p = f"model.layers.{layer}."
        for part, name in own.items():
            add(f"blk.{layer}.{part}.weight", f"{p}{name}.weight", router_type if part == "ffn_gate_inp" else None)
        for part, proj in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            names = [f"{p}mlp.experts.{e}.{proj}.weight" for e in range(experts)]
            raw = quantize(np.stack([tensors[n] for n in names]).astype(np.float32), expert_type)
            writer.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", raw, raw_shape=raw.shape, raw_dtype=expert_type)
            values = dequantize(raw, expert_type)
            held |= {n: values[e] for e, n in enumerate(names)}
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held
