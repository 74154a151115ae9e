"""Phi-3 (mini and medium, 4k and 128k without LongRoPE): LLaMA's decoder, whose checkpoints fuse q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj` (gate rows first), the layout the graph weights already have."""
from __future__ import annotations

from typing import Any, Mapping

from .. import decoder
from ..config import ModelConfig
from ..family import ConfigError, GraphWeight, ModelFamily
from . import hf_config


def layer(config: ModelConfig, i: int) -> list[GraphWeight]:
    p = f"model.layers.{i}."
    return [decoder.qkv(config, i, [p + "self_attn.qkv_proj.weight"]),
            decoder.o_proj(config, i, p + "self_attn.o_proj.weight"),
            decoder.norm(f"layers.{i}.input_norm", p + "input_layernorm.weight", config.hidden_size),
            decoder.norm(f"layers.{i}.post_norm", p + "post_attention_layernorm.weight", config.hidden_size),
            decoder.gate_up(config, i, [p + "mlp.gate_up_proj.weight"]),
            decoder.down(config, i, p + "mlp.down_proj.weight")]


def weights(config: ModelConfig) -> list[GraphWeight]:
    return decoder.model_weights(config, layer)


def config(hf: Mapping[str, Any]) -> ModelConfig:
    hf_config.refuse_sliding_window(hf, active=True)  # Phi-3 applies sliding_window whenever it is set
    rotary = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if rotary != 1.0:
        raise ConfigError(f"partial_rotary_factor={rotary}: rotary embeddings over part of each head (Phi-4-mini) "
                          "are not supported; the Rope op rotates whole heads")
    hf_config.refuse_mlp_variants(hf)
    return hf_config.decoder_config(hf, "phi3")


FAMILY = ModelFamily(name="phi3", hf_classes=("Phi3ForCausalLM",), gguf_architecture=None, config=config,
                     weights=weights, build=decoder.Decoder().build)
