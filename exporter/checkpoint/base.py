"""What every checkpoint reader hands to the exporter."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from graphs.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint that cannot be read; the message says which file and what to do."""


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as HF `tokenizers` JSON, plus what generation needs from it."""

    tokenizer_json: str
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool


@dataclass(frozen=True)
class Checkpoint:
    """Weights in float32 numpy under canonical HF LLaMA names, [out, in] for linear layers.

    Canonical names: `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`
    (absent when tied), and per layer i `model.layers.{i}.input_layernorm.weight`,
    `.self_attn.{q,k,v,o}_proj.weight`, `.self_attn.{q,k,v}_proj.bias` (Qwen2),
    `.post_attention_layernorm.weight`, `.mlp.{gate,up,down}_proj.weight`.
    Q/K projections are in HF's rotate-half layout (GGUF's interleaved layout is undone by the reader).
    """

    config: ModelConfig
    tensors: Mapping[str, np.ndarray]
    tokenizer: TokenizerSpec
    source: str
