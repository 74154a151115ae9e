"""Inputs the op-by-lowering walk runs every body on: packed steps laid out as the runtime's packer lays them."""
from __future__ import annotations

import numpy as np


def normal(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def rope_tables(rng: np.random.Generator, tokens: int, head_dim: int, spread: float = 6.0) -> tuple[np.ndarray, ...]:
    """Per-token cos/sin rows [tokens, head_dim] with duplicated halves, as graphs/rope_tables builds them."""
    angles = rng.uniform(0, spread, (tokens, head_dim // 2))
    return tuple(np.concatenate([f(angles)] * 2, axis=1).astype(np.float32) for f in (np.cos, np.sin))


def packed_step(rng: np.random.Generator, q_lens: list[int], context_lens: list[int], *, heads: int, kv_heads: int,
                head_dim: int, block_size: int, max_blocks: int, pad_seqs: int = 0,
                pad_tokens: int = 0) -> tuple[np.ndarray, ...]:
    """query, k_cache, v_cache, block_tables, context_lens, cu_seqlens_q of one step.

    Sequences own distinct random blocks (block 0, the null block, is never handed out); padding
    sequences have no queries and the null block, padding tokens follow the last sequence.
    """
    num_blocks = 1 + len(q_lens) * max_blocks
    tables = np.zeros((len(q_lens) + pad_seqs, max_blocks), np.int32)
    free = rng.permutation(np.arange(1, num_blocks))
    for b, ctx in enumerate(context_lens):
        used = -(-ctx // block_size)
        tables[b, :used] = free[b * max_blocks:b * max_blocks + used]
    cu = np.concatenate([[0], np.cumsum(q_lens), np.full(pad_seqs, sum(q_lens))]).astype(np.int32)
    pool = (num_blocks * block_size, kv_heads * head_dim)
    return (normal(rng, sum(q_lens) + pad_tokens, heads * head_dim), normal(rng, *pool), normal(rng, *pool), tables,
            np.array(list(context_lens) + [0] * pad_seqs, np.int32), cu)


def random_step(rng: np.random.Generator, batch: int, max_blocks: int, block_size: int,
                decode: bool) -> tuple[list[int], list[int]]:
    """q_lens and context_lens of a random step's real sequences, multi-query ones first (the packer's order)."""
    real = int(rng.integers(1, batch + 1))
    context = [int(rng.integers(1, max_blocks * block_size + 1)) for _ in range(real)]
    q_lens = [1 if decode else int(rng.integers(1, c + 1)) for c in context]
    order = sorted(range(real), key=lambda b: q_lens[b] == 1)
    return [q_lens[b] for b in order], [context[b] for b in order]
