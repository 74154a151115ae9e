"""One rank's graph weights: each fused linear cut along its output rows (column-parallel) or its input columns
(row-parallel) as graphs/tensor_parallel.py lays the ranks out, a stack of experts expert by expert; every other
weight (a MoE router too) replicated.

Float (float32, bfloat16), block-quantized and int8 per-channel weights are cut alike: a block-quantized weight's
input columns are cut at whole blocks, so a row-parallel linear needs its per-rank inputs to be a multiple of the
block size (a weight with one scale per row, w8a16's, is re-blocked to fit first).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from ..graphs import models
from ..graphs.config import ModelConfig
from ..graphs.family import GraphWeight, Split
from ..graphs.quant import BlockQuantized, ExpertStack, Int8PerChannel, Weight
from ..graphs.tensor_parallel import FIELD, RankShard, TensorParallelError
from .quantize import BLOCK_SIZES

COLUMN_PARALLEL = (Split.QKV_ROWS, Split.HALVES_ROWS, Split.EXPERT_HALVES_ROWS)  # rank r keeps some output rows
# rank r keeps some input columns: a partial sum
ROW_PARALLEL = (Split.HEAD_COLUMNS, Split.CHANNEL_COLUMNS, Split.EXPERT_CHANNEL_COLUMNS)


def _span(start: int, stop: int, width: int, offset: int = 0) -> np.ndarray:
    return np.arange(offset + start * width, offset + stop * width)


def rank_rows(config: ModelConfig, split: Split, shard: RankShard) -> np.ndarray:
    """The output rows of a column-parallel weight that `shard` keeps: its query heads, then its K and V heads
    (fused QKV); its gate channels, then its up channels (fused gate/up; each expert's, of a stack)."""
    d = config.head_dim
    if split is Split.HALVES_ROWS:
        return np.concatenate([_span(*shard.intermediate, 1), _span(*shard.intermediate, 1, config.intermediate_size)])
    if split is Split.EXPERT_HALVES_ROWS:
        width = config.moe.intermediate_size  # type: ignore[union-attr]
        return np.concatenate([_span(*shard.expert_intermediate, 1), _span(*shard.expert_intermediate, 1, width)])
    return np.concatenate([_span(*shard.heads, d), _span(*shard.kv_heads, d, config.q_size),
                           _span(*shard.kv_heads, d, config.q_size + config.kv_size)])


def rank_columns(config: ModelConfig, split: Split, shard: RankShard) -> slice:
    """The input columns of a row-parallel weight that `shard` keeps: its heads' (o_proj), its channels' (down; each
    expert's, of a stack)."""
    if split is Split.CHANNEL_COLUMNS:
        return slice(*shard.intermediate)
    if split is Split.EXPERT_CHANNEL_COLUMNS:
        return slice(*shard.expert_intermediate)
    return slice(shard.heads[0] * config.head_dim, shard.heads[1] * config.head_dim)


def shard_weight(config: ModelConfig, spec: GraphWeight, w: Weight, shard: RankShard) -> Weight:
    """Graph weight `w` (declared by `spec`) as rank `shard` holds it."""
    split = spec.role.split
    if split in COLUMN_PARALLEL:
        return _rows(w, rank_rows(config, split, shard))
    if split in ROW_PARALLEL:
        return _columns(w, rank_columns(config, split, shard), spec.name)
    return w


class ShardedWeights(Mapping[str, Weight]):
    """Graph weights (graphs/models.graph_weights) as rank `shard` holds them, each cut when read."""

    def __init__(self, weights: Mapping[str, Weight], config: ModelConfig, shard: RankShard) -> None:
        self._weights, self._config, self._shard = weights, config, shard
        self._table = models.weight_table(config)

    def __getitem__(self, name: str) -> Weight:
        return shard_weight(self._config, self._table[name], self._weights[name], self._shard)

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)


def _rows(w: Weight, rows: np.ndarray) -> Weight:
    if isinstance(w, ExpertStack):
        return ExpertStack(tuple(e.rows(rows) for e in w.experts))
    if isinstance(w, np.ndarray) and w.ndim == 3:  # a float stack of experts [E, out, in]
        return np.ascontiguousarray(w[:, rows])
    if isinstance(w, BlockQuantized):
        return w.rows(rows)
    if isinstance(w, Int8PerChannel):
        return Int8PerChannel(np.ascontiguousarray(w.q[rows]), np.ascontiguousarray(w.scale[rows]), w.source)
    return np.ascontiguousarray(w[rows])


def _columns(w: Weight, cols: slice, name: str) -> Weight:
    if isinstance(w, ExpertStack):
        return ExpertStack(tuple(_columns(e, cols, name) for e in w.experts))  # type: ignore[misc]
    if isinstance(w, np.ndarray) and w.ndim == 3:
        return np.ascontiguousarray(w[:, :, cols])
    if isinstance(w, Int8PerChannel):  # one scale per output row: every rank keeps all of them
        return Int8PerChannel(np.ascontiguousarray(w.q[:, cols]), w.scale, w.source)
    if not isinstance(w, BlockQuantized):
        return np.ascontiguousarray(w[:, cols])
    if cols.start % w.block_size or cols.stop % w.block_size:
        w = _per_row_reblocked(w, cols)
    if cols.start % w.block_size or cols.stop % w.block_size:
        raise TensorParallelError(f"{FIELD}: {name} is quantized in blocks of {w.block_size} inputs, and a rank's "
                                  f"inputs {cols.start}..{cols.stop} do not start and end on a block; choose a "
                                  "tensor-parallel size whose per-rank inputs are a multiple of the block size")
    blocks = slice(cols.start // w.block_size, cols.stop // w.block_size)

    def cut(a: np.ndarray | None, where: slice) -> np.ndarray | None:
        return None if a is None else np.ascontiguousarray(a[:, where])

    return BlockQuantized(cut(w.q, cols), cut(w.scale, blocks), cut(w.zero_point, blocks), cut(w.minimum, blocks),
                          w.bits, w.block_size, w.source)


def _per_row_reblocked(w: BlockQuantized, cols: slice) -> BlockQuantized:
    """`w` in the largest MatMulNBits blocks that `cols` starts and ends on, where its blocks only repeat one scale
    and zero point per row (w8a16: the same weight, other blocks); else `w` as it is."""
    fits = [b for b in BLOCK_SIZES if not (cols.start % b or cols.stop % b)]
    per_row = (w.minimum is None and (w.scale == w.scale[:, :1]).all() and (w.zero_point == w.zero_point[:, :1]).all())
    if not fits or not per_row:
        return w
    blocks = w.q.shape[1] // fits[0]
    scale, zero_point = (np.repeat(a[:, :1], blocks, axis=1) for a in (w.scale, w.zero_point))
    return BlockQuantized(w.q, scale, zero_point, None, w.bits, fits[0], w.source)
