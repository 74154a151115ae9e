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
class MoeConfig:
    """A Mixture-of-Experts model's sparse layers (graphs/moe.py): plain data, recorded in the manifest.

    Each sparse layer's FFN routes every token to `top_k` of `num_experts` SwiGLU experts of width
    `intermediate_size` (Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size); the other layers keep the
    dense SwiGLU MLP of ModelConfig.intermediate_size (Qwen3-MoE's mlp_only_layers and decoder_sparse_step)."""

    num_experts: int
    top_k: int  # num_experts_per_tok
    intermediate_size: int
    norm_topk_prob: bool  # the k routing weights renormalized to sum 1 (Mixtral always)
    sparse_layers: tuple[int, ...]

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok = {self.top_k} with {self.num_experts} experts: each token reads "
                             "between 1 and num_experts experts")

    def expert_parameters(self, hidden_size: int) -> int:
        """Parameters of one expert (gate, up and down)."""
        return 3 * hidden_size * self.intermediate_size

    def layer_parameters(self, hidden_size: int) -> tuple[int, int]:
        """(stored, read per token) parameters of one sparse layer's FFN: the router and all experts, or top_k."""
        router, expert = self.num_experts * hidden_size, self.expert_parameters(hidden_size)
        return router + self.num_experts * expert, router + self.top_k * expert


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
    moe: MoeConfig | None = None  # a Mixture-of-Experts model's sparse layers (None: every layer dense)

    def __post_init__(self) -> None:
        if self.moe is not None and not set(self.moe.sparse_layers) <= set(range(self.num_layers)):
            raise ValueError(f"sparse layers {list(self.moe.sparse_layers)} outside the model's {self.num_layers}")
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
        if data.get("moe"):  # manifests before MoE have no such key: dense
            data["moe"] = MoeConfig(**{**data["moe"], "sparse_layers": tuple(data["moe"]["sparse_layers"])})
        return cls(**data)
