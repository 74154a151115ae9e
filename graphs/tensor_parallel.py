"""Tensor parallelism over N ranks (Megatron's split, as vLLM and MindIE shard LLaMA): what each rank holds.

Column-parallel: QKV (rank r's query heads and its KV heads) and gate/up (its slice of the intermediate size; in a
MoE layer, its slice of every expert's), so attention and SwiGLU run on local data. Row-parallel: o_proj and down take those local slices as inputs and give a
partial sum of the hidden state, which an AllReduce completes before the residual Add (two per layer).

The embedding and the LM head are replicated, not vocab-parallel: every rank gathers whole rows and computes the
whole logits, so no collective is needed before the first layer or after the last (vocab-parallel would take an
AllReduce of the embedding rows and an AllGather of the logits), and a tied head keeps its one table. It costs
each rank the full table (LLaMA-2-70B: 2 x 0.5 GiB at fp16 per rank, docs/scale-out.md).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .config import ModelConfig

FIELD = "export.tensor_parallel_size"


class TensorParallelError(ValueError):
    """A tensor-parallel size the model cannot be split by."""


@dataclass(frozen=True)
class RankShard:
    """Rank `rank` of `size`: its half-open ranges of query heads, KV heads and intermediate channels."""

    rank: int
    size: int
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    expert_intermediate: tuple[int, int] = (0, 0)  # of each expert (MoeConfig.intermediate_size); none when dense


def _split_dims(config: ModelConfig) -> list[tuple[str, int]]:
    dims = [("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
            ("intermediate_size", config.intermediate_size)]
    return dims + ([("the experts' intermediate size", config.moe.intermediate_size)] if config.moe else [])


def check_size(config: ModelConfig, size: int) -> None:
    """`size` must divide the query heads, the KV heads and the intermediate sizes, dense and each expert's (each
    rank owns whole heads)."""
    if size < 1:
        raise TensorParallelError(f"{FIELD} = {size}: must be at least 1")
    problems = [f"{name} = {value}" for name, value in _split_dims(config) if value % size]
    if problems:
        valid = [n for n in range(1, config.num_kv_heads + 1) if not any(v % n for _, v in _split_dims(config))]
        raise TensorParallelError(f"{FIELD} = {size} must divide the model's {', '.join(problems)} (each rank "
                                  f"holds whole heads); valid sizes for this model: {valid}")


def rank_config(config: ModelConfig, size: int) -> ModelConfig:
    """The model as one rank sees it: its heads, KV heads and intermediate channels (hidden and vocab whole)."""
    check_size(config, size)
    moe = None if config.moe is None else dataclasses.replace(config.moe,
                                                              intermediate_size=config.moe.intermediate_size // size)
    return dataclasses.replace(config, num_heads=config.num_heads // size, num_kv_heads=config.num_kv_heads // size,
                               intermediate_size=config.intermediate_size // size, moe=moe)


def shards(config: ModelConfig, size: int) -> tuple[RankShard, ...]:
    """Every rank's shard, rank 0 first."""
    local = rank_config(config, size)

    def span(rank: int, width: int) -> tuple[int, int]:
        return rank * width, (rank + 1) * width

    experts = 0 if local.moe is None else local.moe.intermediate_size
    return tuple(RankShard(r, size, span(r, local.num_heads), span(r, local.num_kv_heads),
                           span(r, local.intermediate_size), span(r, experts)) for r in range(size))
