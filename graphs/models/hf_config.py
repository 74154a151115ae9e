"""Reading a Hugging Face config.json (as a dict) into a ModelConfig: the fields every decoder family shares, and
the refusals a family picks from, so a checkpoint the graphs cannot run faithfully fails naming the field and the fix.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config import ModelConfig, RopeScaling
from ..family import ConfigError

LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def int_field(hf: Mapping[str, Any], name: str, default: int | None = None) -> int:
    """A required integer field (or `default` where the field is absent)."""
    value = hf.get(name, default)
    if value is None:
        raise ConfigError(f"missing field {name!r}; add it from the model's original config.json")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"field {name!r} must be an integer, got {value!r}")
    return value


def rope(hf: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and llama3 scaling from either layout: transformers < 5 writes `rope_theta` plus `rope_scaling`;
    transformers >= 5 one `rope_parameters` dict holding `rope_theta` and the scaling fields."""
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ConfigError(f"rope scaling type {rope_type!r} is not supported: the Rope op implements only plain RoPE "
                          "and llama3 frequency scaling, so positions would be encoded differently than in training; "
                          "use a checkpoint without this rope scaling")
    missing = [key for key in LLAMA3_FIELDS if key not in params]
    if missing:
        raise ConfigError(f"llama3 rope scaling lacks {', '.join(missing)}; add them to rope_scaling")
    return float(theta), RopeScaling(*(float(params[k]) for k in LLAMA3_FIELDS[:3]),
                                     int(params["original_max_position_embeddings"]))


def refuse_sliding_window(hf: Mapping[str, Any], active: bool) -> None:
    """Sliding-window attention is refused where it would change outputs: `active` (the family applies the window;
    Qwen2/3 only with use_sliding_window) and a window shorter than the positions."""
    window, positions = hf.get("sliding_window"), int_field(hf, "max_position_embeddings")
    if active and window is not None and window < positions:
        raise ConfigError(
            f"sliding_window={window} < max_position_embeddings={positions}: sliding-window attention is not "
            f"supported (PagedAttention attends over the whole context, so outputs past {window} tokens would "
            f"differ); to export anyway, cap the context by setting max_position_embeddings to {window} in "
            "config.json")


def qwen_window_active(hf: Mapping[str, Any]) -> bool:
    """Qwen2 and Qwen3 apply sliding_window only with use_sliding_window (or a sliding layer type)."""
    return bool(hf.get("use_sliding_window")) or "sliding_attention" in (hf.get("layer_types") or [])


def refuse_attention_bias(hf: Mapping[str, Any]) -> None:
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true adds an o_proj bias, which the graphs do not implement (only Qwen2's "
                          "q/k/v biases are supported)")


def refuse_mlp_variants(hf: Mapping[str, Any]) -> None:
    """The MLP is bias-free SwiGLU."""
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias=true is not supported (the MLP is bias-free SwiGLU)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported; the MLP is SwiGLU (silu)")


def decoder_config(hf: Mapping[str, Any], architecture: str, attention_bias: bool = False) -> ModelConfig:
    """The fields every decoder family reads: dims, norm epsilon, rope, positions, tied embeddings. Token ids are
    the tokenizer files' (the reader fills them in)."""
    hidden, heads = int_field(hf, "hidden_size"), int_field(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}; set head_dim "
                              "explicitly")
        head_dim = hidden // heads
    theta, scaling = rope(hf)
    return ModelConfig(
        architecture=architecture, vocab_size=int_field(hf, "vocab_size"), hidden_size=hidden,
        intermediate_size=int_field(hf, "intermediate_size"), num_layers=int_field(hf, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        max_position_embeddings=int_field(hf, "max_position_embeddings"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)), attention_bias=attention_bias,
        rope_scaling=scaling)


def moe_variants(hf: Mapping[str, Any]) -> list[str]:
    """What a Mixture-of-Experts config.json asks beyond routed top-k experts (graphs/moe.py), each naming the
    fields and what the graphs would need: shared experts, DeepSeek's grouped routing, an expert score bias, other
    scoring. Empty for Qwen3-MoE and Mixtral."""
    missing = []
    shared = [f"{k}={hf[k]}" for k in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts")
              if hf.get(k)]
    if shared:
        missing.append(f"shared experts ({', '.join(shared)}: Qwen2-MoE / DeepSeek's always-on expert beside the "
                       "routed ones; missing: a dense SwiGLU per sparse layer added to the routed output, with "
                       "Qwen2-MoE's sigmoid gate)")
    grouped = [f"{k}={hf[k]}" for k in ("n_group", "topk_group") if (hf.get(k) or 1) > 1]
    if grouped:
        missing.append(f"DeepSeek's grouped routing ({', '.join(grouped)}: the top-k chosen within the best expert "
                       "groups; missing: group selection before MoeGatingTopKSoftmax, Ascend's MoeGatingTopK)")
    if hf.get("topk_method") == "noaux_tc" or hf.get("moe_router_enable_expert_bias"):
        missing.append("an expert score bias (topk_method=noaux_tc: e_score_correction_bias added to the scores "
                       "that pick the experts, not to their weights; missing: a bias input of the gating op)")
    scoring = hf.get("scoring_func", "softmax")
    if scoring != "softmax":
        missing.append(f"scoring_func={scoring!r} (missing: {scoring} gating; MoeGatingTopKSoftmax is softmax)")
    scale = hf.get("routed_scaling_factor", 1.0)
    if scale != 1.0:
        missing.append(f"routed_scaling_factor={scale} (missing: the routed output's scale)")
    return missing


def refuse_moe_variants(hf: Mapping[str, Any]) -> None:
    missing = moe_variants(hf)
    if missing:
        raise ConfigError("this Mixture-of-Experts model needs what the graphs do not implement (routed top-k "
                          "experts only): " + "; ".join(missing))
