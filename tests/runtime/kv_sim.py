"""Test helpers for the KV manager and scheduler: a shadow of the pool's contents.

The shadow records which token's K/V each pool slot holds, as the graph would write it, so a test
can check that every sequence reads exactly its own tokens through its block table (prefix reuse,
copy-on-write and preemption all get this wrong loudly).
"""
from __future__ import annotations

from pagedgraph.graphs.contract import NULL_BLOCK
from pagedgraph.runtime.kv_cache_manager import KVCacheManager
from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.scheduler import Sequence


def make_seq(tokens: list[int], name: str = "r", arrival: float = 0.0) -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(temperature=0), arrival=arrival)


class Shadow:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        bs = self.bs
        for src, dst in pairs:
            self.slots[dst * bs:(dst + 1) * bs] = self.slots[src * bs:(src + 1) * bs]

    def write(self, seq: Sequence, start: int, n: int) -> None:
        for pos in range(start, start + n):
            self.slots[self._slot(seq, pos)] = seq.token_ids[pos]

    def read(self, seq: Sequence, length: int) -> list[int | None]:
        return [self.slots[self._slot(seq, p)] for p in range(length)]

    def check(self, seq: Sequence) -> None:
        n = seq.num_computed_tokens
        assert self.read(seq, n) == seq.token_ids[:n], f"{seq.request_id} reads wrong K/V"

    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs


def check_invariants(kv: KVCacheManager, live: list[Sequence]) -> None:
    """free + cached + used == pool; queued exactly when unreferenced; ref counts == holders."""
    pool = kv.pool
    queued = list(pool.free_queue)
    queued_ids = {b.block_id for b in queued}
    assert len(queued_ids) == len(queued) == pool.num_free
    holders = [0] * pool.num_blocks
    for seq in live:
        assert NULL_BLOCK not in seq.block_table
        assert len(seq.block_table) * kv.block_size >= seq.num_computed_tokens
        for b in seq.block_table:
            holders[b] += 1
    free = cached = used = 0
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}: ref_cnt vs holders"
        in_queue = block.block_id in queued_ids
        assert in_queue == (block.ref_cnt == 0), f"block {block.block_id} both free and referenced"
        if block.ref_cnt:
            used += 1
        elif block.block_hash is None:
            free += 1
        else:
            cached += 1
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    assert free + cached + used == pool.num_blocks - 1
    assert len(pool.cached) == sum(b.block_hash is not None for b in pool.blocks)
    assert pool.blocks[NULL_BLOCK].ref_cnt == 0 and NULL_BLOCK not in queued_ids
    assert kv.stats.hits <= kv.stats.queries
