"""LLaMA 2/3 (and SmolLM2, TinyLlama): the decoder as Meta wrote it, GQA, optional llama3 rope scaling."""
from __future__ import annotations

from typing import Any, Mapping

from .. import decoder
from ..config import ModelConfig
from ..family import GraphWeight, ModelFamily
from . import hf_config


def layer(config: ModelConfig, i: int) -> list[GraphWeight]:
    """Layer i's weights under transformers' LlamaDecoderLayer names (Mistral, Qwen2 and Qwen3 share them)."""
    return attention(config, i) + mlp(config, i)


def attention(config: ModelConfig, i: int) -> list[GraphWeight]:
    """Layer i's attention and its two norms (the MoE families' too)."""
    p = f"model.layers.{i}."
    return [decoder.qkv(config, i, [f"{p}self_attn.{x}_proj.weight" for x in "qkv"]),
            decoder.o_proj(config, i, p + "self_attn.o_proj.weight"),
            decoder.norm(f"layers.{i}.input_norm", p + "input_layernorm.weight", config.hidden_size),
            decoder.norm(f"layers.{i}.post_norm", p + "post_attention_layernorm.weight", config.hidden_size)]


def mlp(config: ModelConfig, i: int) -> list[GraphWeight]:
    """Layer i's dense SwiGLU MLP (Qwen3-MoE's dense layers too)."""
    p = f"model.layers.{i}.mlp."
    return [decoder.gate_up(config, i, [p + "gate_proj.weight", p + "up_proj.weight"]),
            decoder.down(config, i, p + "down_proj.weight")]


def weights(config: ModelConfig) -> list[GraphWeight]:
    return decoder.model_weights(config, layer)


def config(hf: Mapping[str, Any]) -> ModelConfig:
    hf_config.refuse_sliding_window(hf, active=True)
    hf_config.refuse_attention_bias(hf)
    hf_config.refuse_mlp_variants(hf)
    return hf_config.decoder_config(hf, "llama")


FAMILY = ModelFamily(name="llama", hf_classes=("LlamaForCausalLM",), gguf_architecture="llama", config=config,
                     weights=weights, build=decoder.Decoder().build, gguf_rope_permuted=True)
