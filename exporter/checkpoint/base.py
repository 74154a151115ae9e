"""What every checkpoint reader hands to the exporter."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from ...graphs.config import ModelConfig
from ...graphs.quant import Weight


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


class LazyTensors(Mapping[str, Weight]):
    """Checkpoint tensors read from their file each time they are accessed, and never kept: the exporter holds one
    tensor (or one fused graph weight) at a time, whatever the checkpoint's size."""

    def __init__(self, loaders: Mapping[str, Callable[[], Weight]]) -> None:
        self._loaders = loaders

    def __getitem__(self, name: str) -> Weight:
        return self._loaders[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


@dataclass(frozen=True)
class Checkpoint:
    """Weights under canonical HF LLaMA names, [out, in] for linear layers (read on access: `LazyTensors`): float32
    numpy, or
    `BlockQuantized` where a GGUF was read with its blocks kept (export `quantization: gguf`) or an HF
    checkpoint was quantized with GPTQ / AWQ (always kept: `quantization`).

    Canonical names: `model.embed_tokens.weight`, `model.norm.weight`, `lm_head.weight`
    (absent when tied), and per layer i `model.layers.{i}.input_layernorm.weight`,
    `.self_attn.{q,k,v,o}_proj.weight`, `.self_attn.{q,k,v}_proj.bias` (Qwen2),
    `.post_attention_layernorm.weight`, `.mlp.{gate,up,down}_proj.weight`.
    Q/K projections are in HF's rotate-half layout (GGUF's interleaved layout is undone by the reader).
    """

    config: ModelConfig
    tensors: Mapping[str, Weight]
    tokenizer: TokenizerSpec
    source: str
    # The checkpoint's own sampling defaults (HF generation_config.json), under SamplingParams' names; GGUF has none.
    generation_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    generation_source: str = ""  # where generation_defaults came from, recorded in the manifest
    # The checkpoint's own quantization, read as it is: "gptq" / "awq" (HF quantization_config), else "none".
    quantization: str = "none"


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical tensor this config implies, with its [out, in] shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (c.hidden_size,),
            f"{p}.self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            f"{p}.self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            f"{p}.self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            f"{p}.self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            f"{p}.post_attention_layernorm.weight": (c.hidden_size,),
            f"{p}.mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            f"{p}.mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            f"{p}.mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.attention_bias:
            shapes |= {
                f"{p}.self_attn.q_proj.bias": (c.q_size,),
                f"{p}.self_attn.k_proj.bias": (c.kv_size,),
                f"{p}.self_attn.v_proj.bias": (c.kv_size,),
            }
    return shapes
