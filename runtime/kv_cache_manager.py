"""Decides which blocks a sequence gets (prefix hits, fresh blocks, copy-on-write); the BlockPool owns them.

A sequence's `block_table` holds block ids (what the packer reads); the manager keeps, per
sequence, the hashes of its full blocks and how many of its blocks are registered in the cache.

Block hashes: each full block's hash chains its parent's hash and its token ids, so a hash names the
whole prefix up to the block's end, and equal hashes mean equal K/V (same model, same positions).
SHA-256 keeps accidental collisions, which would silently serve another prompt's K/V, out of reach;
the salt separates deployments that must not share blocks (its digest is the root parent). The
manager is the only one that computes them; the pool only maps them to blocks.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Sequence as Tokens

from .block_pool import BlockPool, CacheStats, KVBlock
from .kv_pools import KVPools
from .sequence import Sequence

CopyPairs = list[tuple[int, int]]


def root_hash(salt: bytes) -> bytes:
    return hashlib.sha256(b"pagedgraph-prefix-root:" + salt).digest()


def block_hash(parent: bytes, token_ids: Tokens[int]) -> bytes:
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_hashes(hashes: list[bytes], root: bytes, token_ids: Tokens[int], block_size: int,
                  num_blocks: int) -> None:
    """Grow `hashes` (one per full block of `token_ids`, in order) to `num_blocks` entries."""
    for b in range(len(hashes), num_blocks):
        parent = hashes[b - 1] if b else root
        hashes.append(block_hash(parent, token_ids[b * block_size:(b + 1) * block_size]))


@dataclass(frozen=True)
class KVUsage:
    """The pool's blocks now, the null block excluded (for metrics and admission)."""

    total: int
    free: int  # evictable prefix-cache blocks included
    cached: int  # registered in the prefix cache, used or evictable


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 salt: bytes = b"") -> None:
        self.block_size = block_size
        self.stats = CacheStats()
        self.pool = BlockPool(num_blocks, enable_prefix_caching, self.stats)
        self.enable_prefix_caching = enable_prefix_caching
        self._root = root_hash(salt)
        self._hashes: dict[Sequence, list[bytes]] = {}
        self._num_registered: dict[Sequence, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> KVUsage:
        return KVUsage(self.pool.num_blocks - 1, self.pool.num_free, self.pool.num_cached)

    def _full_hashes(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq, [])
        extend_hashes(hashes, self._root, seq.token_ids, self.block_size, num_tokens // self.block_size)
        return hashes

    def computed_blocks(self, seq: Sequence) -> list[KVBlock]:
        """The longest chain of cached blocks that starts `seq` (a sequence with nothing in the pool).

        The last token is always left to compute, so the step that finishes the prompt has logits.
        """
        if not self.enable_prefix_caching or seq.block_table:
            return []
        hits = []
        for h in self._full_hashes(seq, seq.num_tokens - 1):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _needs_copy(self, seq: Sequence, start: int) -> bool:
        """True when the first token written this step lands in a partly filled block that others hold."""
        index = start // self.block_size
        return start % self.block_size != 0 and index < len(seq.block_table) \
            and self.pool.blocks[seq.block_table[index]].ref_cnt > 1

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed: list[KVBlock] | None = None) -> CopyPairs | None:
        """Make room for `num_new_tokens` after the computed ones (and the `computed` prefix hits).

        Returns the block copies (src, dst) that must run before this step's graph (copy-on-write),
        or None, with nothing changed, when the pool is short.
        """
        bs = self.block_size
        computed = computed or []
        admission = not seq.block_table
        start = seq.num_computed_tokens + len(computed) * bs
        total = start + num_new_tokens
        fresh = max(0, -(-total // bs) - len(seq.block_table) - len(computed))
        copy = self._needs_copy(seq, start)
        reused_from_queue = sum(1 for b in computed if b.ref_cnt == 0)
        if fresh + copy > self.pool.num_free - reused_from_queue:
            return None
        self.pool.touch(computed)  # before allocating, so a hit is never evicted to make room for itself
        table = seq.block_table
        table.extend(b.block_id for b in computed)
        seq.num_computed_tokens = start
        if admission:
            self.stats.queries += seq.num_tokens
            self.stats.hits += start
            self._num_registered[seq] = len(computed)
            if seq.num_tokens == seq.num_prompt_tokens:
                seq.num_cached_tokens = start
        copies: CopyPairs = []
        if copy:
            index = start // bs
            (dst,) = self.pool.allocate(1)
            copies.append((table[index], dst.block_id))
            self.pool.free([self.pool.blocks[table[index]]])
            table[index] = dst.block_id
        table.extend(b.block_id for b in self.pool.allocate(fresh))
        return copies

    def cache_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Register the blocks that are full once `seq` holds `num_tokens` tokens' K/V.

        The scheduler calls this for a step's sequences once none of them can be preempted in that
        step: the graph writes all new K/V of a layer before any query of that layer reads, so a
        request admitted later in the same step may already share these blocks.
        """
        num_tokens = min(num_tokens, seq.num_verified_tokens)  # drafts never enter the cache, nor its hash chain
        full = num_tokens // self.block_size
        done = self._num_registered.get(seq, 0)
        if not self.enable_prefix_caching or full <= done:
            return
        hashes = self._full_hashes(seq, num_tokens)
        blocks = self.pool.blocks
        for i in range(done, full):
            self.pool.cache(blocks[seq.block_table[i]], hashes[i])
        self._num_registered[seq] = full

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """Keep the K/V of the first `num_computed` tokens only (drafts the target rejected): the blocks past them
        go back to the pool, the table entries are dropped, nothing is copied.

        Those blocks held only drafts, so they are unhashed (`cache_blocks` skips drafts) and fresh for this
        sequence alone (ref_cnt 1): after the rollback, refcounts, hashes and the free count are those of a run
        that never proposed them."""
        keep = -(-num_computed // self.block_size)
        blocks = self.pool.blocks
        self.pool.free([blocks[b] for b in reversed(seq.block_table[keep:])])
        del seq.block_table[keep:]
        seq.num_computed_tokens = num_computed

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (a copy of its tokens); writes copy shared partial blocks."""
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        self.pool.touch([self.pool.blocks[b] for b in child.block_table])
        if parent in self._hashes:
            self._hashes[child] = list(self._hashes[parent])
        self._num_registered[child] = self._num_registered.get(parent, 0)

    def free(self, seq: Sequence, keep_cached: bool = True) -> None:
        """Release the sequence's blocks tail first; `keep_cached=False` when their contents are suspect."""
        blocks = self.pool.blocks
        self.pool.free([blocks[b] for b in reversed(seq.block_table)], keep_cached)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._hashes.pop(seq, None)
        self._num_registered.pop(seq, None)


@dataclass(frozen=True)
class SharedKV:
    """An engine's KV pools with the manager of their blocks: what a draft of the same model runs on instead of a
    pool of its own (runtime/spec/draft.py)."""

    pools: KVPools
    manager: KVCacheManager
