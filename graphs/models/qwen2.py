"""Qwen2 / Qwen2.5: LLaMA's decoder with a bias on the q, k and v projections."""
from __future__ import annotations

from typing import Any, Mapping

from .. import decoder
from ..config import ModelConfig
from ..family import GraphWeight, ModelFamily
from . import hf_config, llama


def layer(config: ModelConfig, i: int) -> list[GraphWeight]:
    p = f"model.layers.{i}.self_attn."
    return llama.layer(config, i) + [decoder.qkv(config, i, [f"{p}{x}_proj.bias" for x in "qkv"], bias=True)]


def weights(config: ModelConfig) -> list[GraphWeight]:
    return decoder.model_weights(config, layer)


def config(hf: Mapping[str, Any]) -> ModelConfig:
    hf_config.refuse_sliding_window(hf, hf_config.qwen_window_active(hf))
    hf_config.refuse_mlp_variants(hf)
    return hf_config.decoder_config(hf, "qwen2", attention_bias=True)


FAMILY = ModelFamily(name="qwen2", hf_classes=("Qwen2ForCausalLM",), gguf_architecture="qwen2", config=config,
                     weights=weights, build=decoder.Decoder().build)
