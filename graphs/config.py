"""The model hyper-parameters every lowering and the runtime agree on."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, get_args

PoolingType = Literal["last", "mean"]
POOLING_TYPES: tuple[str, ...] = get_args(PoolingType)

@dataclass(frozen=True)
class RopeScaling:
    """llama3-style frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class Pooling:
    """An embedding model's head (export.task: embed), in place of the LM head: which rows of the final norm's
    output make a sequence's vector (graphs/decoder.py), and what the runtime does with it (runtime/pooling.py)."""

    type: PoolingType  # last: the last token's row (Qwen3-Embedding); mean: the mean of every token's row
    normalize: bool = True  # L2-normalised, as vLLM's embedding pooler does by default
    # A request may ask for fewer `dimensions` (Matryoshka: the first d, then normalised), any from 1 to the hidden
    # size, or only `matryoshka_dimensions` when it lists some.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.type not in POOLING_TYPES:
            raise ValueError(f"pooling type {self.type!r}: choose one of {', '.join(POOLING_TYPES)}")


@dataclass(frozen=True)
class ModelConfig:
    """The model's dims and flags; `architecture` names its family (graphs/models)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pooling: Pooling | None = None  # an embedding model's head; None: the LM head (logits)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        data = dict(data)
        if data.get("rope_scaling"):
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        data["eos_token_ids"] = tuple(data.get("eos_token_ids", ()))
        if data.get("pooling"):
            pooling = data["pooling"]
            data["pooling"] = Pooling(**{**pooling,
                                         "matryoshka_dimensions": tuple(pooling.get("matryoshka_dimensions", ()))})
        return cls(**data)
