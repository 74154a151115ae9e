"""Mistral: LLaMA's decoder, whose sliding window is refused where it would change outputs."""
from __future__ import annotations

from typing import Any, Mapping

from .. import decoder
from ..config import ModelConfig
from ..family import ModelFamily
from . import hf_config, llama


def config(hf: Mapping[str, Any]) -> ModelConfig:
    hf_config.refuse_sliding_window(hf, active=True)  # Mistral applies sliding_window whenever it is set
    hf_config.refuse_attention_bias(hf)
    hf_config.refuse_mlp_variants(hf)
    return hf_config.decoder_config(hf, "mistral")


FAMILY = ModelFamily(name="mistral", hf_classes=("MistralForCausalLM",), gguf_architecture=None, config=config,
                     weights=llama.weights, build=decoder.Decoder().build)
