"""Qwen3 (dense): Qwen2's decoder without the q/k/v bias, with a per-head RMSNorm on q and k before RoPE, and a
head_dim of its own (Qwen3-0.6B: 16 heads of 128 over a hidden size of 1024)."""
from __future__ import annotations

from typing import Any, Mapping

from .. import decoder
from ..config import ModelConfig
from ..family import ConfigError, GraphWeight, ModelFamily
from . import hf_config, llama


def layer(config: ModelConfig, i: int) -> list[GraphWeight]:
    p = f"model.layers.{i}.self_attn."
    return llama.layer(config, i) + decoder.qk_norms(config, i, p + "q_norm.weight", p + "k_norm.weight")


def weights(config: ModelConfig) -> list[GraphWeight]:
    return decoder.model_weights(config, layer)


def config(hf: Mapping[str, Any]) -> ModelConfig:
    hf_config.refuse_sliding_window(hf, hf_config.qwen_window_active(hf))
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true adds q/k/v and o_proj biases to Qwen3, which the graphs do not "
                          "implement; the released Qwen3 checkpoints have none")
    hf_config.refuse_mlp_variants(hf)
    return hf_config.decoder_config(hf, "qwen3")


FAMILY = ModelFamily(name="qwen3", hf_classes=("Qwen3ForCausalLM",), gguf_architecture="qwen3", config=config,
                     weights=weights, build=decoder.Decoder(qk_norm=True).build)
