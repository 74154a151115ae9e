"""Mixtral (8x7B, 8x22B): Mistral's attention, and in every layer a routed Mixture-of-Experts FFN (graphs/moe.py)
of `num_local_experts` SwiGLU experts of `intermediate_size`, the top `num_experts_per_tok` (2) renormalized.

Experts are read as the released checkpoints store them (`block_sparse_moe.experts.<e>.w1/w3/w2.weight`: gate, up,
down, and `block_sparse_moe.gate.weight`, as transformers 5 saves them too) or fused as transformers 5 names them
with `save_original_format=False` (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
Mixtral's GGUF files say `llama` and are not read here: export from the HF directory.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .. import decoder, moe
from ..config import ModelConfig, MoeConfig
from ..family import GraphWeight, ModelFamily
from . import hf_config, llama


def layer(config: ModelConfig, i: int) -> list[GraphWeight]:
    m, fused = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
    return llama.attention(config, i) + [
        moe.router(config, i, m + "gate.weight", aliases=[fused + "gate.weight"]),
        moe.experts_gate_up(config, i, lambda e: [f"{m}experts.{e}.w1.weight", f"{m}experts.{e}.w3.weight"],
                            [[fused + "experts.gate_up_proj"]]),
        moe.experts_down(config, i, lambda e: [f"{m}experts.{e}.w2.weight"], [fused + "experts.down_proj"])]


def weights(config: ModelConfig) -> list[GraphWeight]:
    return decoder.model_weights(config, layer)


def config(hf: Mapping[str, Any]) -> ModelConfig:
    hf_config.refuse_sliding_window(hf, active=True)
    hf_config.refuse_attention_bias(hf)
    hf_config.refuse_mlp_variants(hf)
    hf_config.refuse_moe_variants(hf)
    base = hf_config.decoder_config(hf, "mixtral")
    return dataclasses.replace(base, moe=MoeConfig(
        hf_config.int_field(hf, "num_local_experts"), hf_config.int_field(hf, "num_experts_per_tok"),
        base.intermediate_size, True, tuple(range(base.num_layers))))


FAMILY = ModelFamily(name="mixtral", hf_classes=("MixtralForCausalLM",), gguf_architecture=None, config=config,
                     weights=weights, build=decoder.Decoder(ffn=moe.sparse_or_dense_ffn).build)
