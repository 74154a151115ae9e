"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B; OLMoE-1B-7B's shape): Qwen3's attention, and in each sparse layer a
routed Mixture-of-Experts FFN (graphs/moe.py: softmax over `num_experts`, the top `num_experts_per_tok`,
renormalized with `norm_topk_prob`, SwiGLU experts of `moe_intermediate_size`). Layers in `mlp_only_layers`, or off
`decoder_sparse_step`, keep Qwen3's dense MLP of `intermediate_size`.

Experts are read as the released checkpoints store them (`mlp.experts.<e>.{gate,up,down}_proj.weight`, as
transformers 5 saves them too), fused (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]:
transformers 5 with `save_original_format=False`), or from a `qwen3moe` GGUF's stacked `ffn_*_exps`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .. import decoder, moe
from ..config import ModelConfig, MoeConfig
from ..family import ConfigError, GraphWeight, ModelFamily
from . import hf_config, llama, qwen3


def layer(config: ModelConfig, i: int) -> list[GraphWeight]:
    p = f"model.layers.{i}."
    attention = llama.attention(config, i) + decoder.qk_norms(config, i, p + "self_attn.q_norm.weight",
                                                              p + "self_attn.k_norm.weight")
    if config.moe is None or i not in config.moe.sparse_layers:
        return attention + llama.mlp(config, i)
    m = p + "mlp."
    return attention + [
        moe.router(config, i, m + "gate.weight"),
        moe.experts_gate_up(config, i, lambda e: [f"{m}experts.{e}.gate_proj.weight", f"{m}experts.{e}.up_proj.weight"],
                            [[m + "experts.gate_up_proj"], [m + "experts.gate_proj.weight", m + "experts.up_proj.weight"]]),
        moe.experts_down(config, i, lambda e: [f"{m}experts.{e}.down_proj.weight"],
                         [m + "experts.down_proj", m + "experts.down_proj.weight"])]


def weights(config: ModelConfig) -> list[GraphWeight]:
    return decoder.model_weights(config, layer)


def sparse_layers(hf: Mapping[str, Any], layers: int) -> tuple[int, ...]:
    """transformers' rule: layer i is sparse unless it is in mlp_only_layers or (i + 1) % decoder_sparse_step."""
    step = hf_config.int_field(hf, "decoder_sparse_step", 1)
    dense = hf.get("mlp_only_layers") or []
    if step < 1 or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
        raise ConfigError(f"decoder_sparse_step={step}, mlp_only_layers={dense}: the step must be at least 1 and "
                          f"the dense layers ids below num_hidden_layers={layers}")
    return tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)


def config(hf: Mapping[str, Any]) -> ModelConfig:
    base = qwen3.config(hf)  # Qwen3's attention and its refusals
    hf_config.refuse_moe_variants(hf)
    # the Hub's configs say num_experts; transformers 5 saves it as num_local_experts
    experts = hf_config.int_field(hf, "num_experts", hf.get("num_local_experts"))
    if experts < 1:
        raise ConfigError(f"num_experts={experts}: a Qwen3-MoE model without experts is a dense Qwen3; export it "
                          "as Qwen3ForCausalLM")
    return dataclasses.replace(base, architecture="qwen3_moe", moe=MoeConfig(
        experts, hf_config.int_field(hf, "num_experts_per_tok"), hf_config.int_field(hf, "moe_intermediate_size"),
        bool(hf.get("norm_topk_prob", False)), sparse_layers(hf, base.num_layers)))


FAMILY = ModelFamily(name="qwen3_moe", hf_classes=("Qwen3MoeForCausalLM",), gguf_architecture="qwen3moe",
                     config=config, weights=weights,
                     build=decoder.Decoder(qk_norm=True, ffn=moe.sparse_or_dense_ffn).build)
