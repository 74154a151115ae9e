"""The pool of KV blocks: reference counts, the hash -> block map of cached full blocks, and the free queue.

Mechanism only; which blocks a sequence gets is decided by the KVCacheManager.

Every block but the null block (block 0, never handed out) is in exactly one state:
  free     ref_cnt == 0, no hash, in the free queue (handed out first);
  cached   ref_cnt == 0, hashed, in the free queue (reusable by a prefix hit, evictable in LRU order);
  used     ref_cnt > 0, not in the free queue (hashed or not).
So free + cached + used == num_blocks - 1, and no block is both queued and referenced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from ..graphs.contract import NULL_BLOCK


@dataclass
class CacheStats:
    """Cumulative KV-cache counters for metrics; queries and hits count prompt tokens at admission."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVBlock:
    """One block's record; `prev`/`next` link it into the free queue while it is there."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Intrusive doubly linked list between two sentinels: O(1) pop, push at either end, and removal.

    Order is eviction order: the head is taken first. Unhashed blocks are pushed at the head (they
    hold nothing worth keeping); cached blocks at the tail, so the head side holds the least recently freed.
    """

    def __init__(self) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:  # head to tail
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def _link(self, block: KVBlock, prev: KVBlock, nxt: KVBlock) -> None:
        block.prev, block.next = prev, nxt
        prev.next = nxt.prev = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        self._link(block, self._tail.prev, self._tail)  # type: ignore[arg-type]

    def appendleft(self, block: KVBlock) -> None:
        self._link(block, self._head, self._head.next)  # type: ignore[arg-type]

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev  # type: ignore[union-attr]
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        if not self._len:
            raise IndexError("pop from an empty free queue")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, stats: CacheStats | None = None) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks = {num_blocks}: need at least 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.stats = stats or CacheStats()
        self.blocks = [KVBlock(b) for b in range(num_blocks)]
        self.cached: dict[bytes, KVBlock] = {}
        self.free_queue = FreeBlockQueue()
        for block in self.blocks:
            if block.block_id != NULL_BLOCK:
                self.free_queue.append(block)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self.free_queue)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a hash, used or evictable."""
        return len(self.cached)

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, count: int) -> list[KVBlock]:
        """`count` fresh blocks (ref_cnt 1), evicting the least recently freed cached blocks if needed."""
        if count > len(self.free_queue):
            raise MemoryError(f"asked for {count} blocks, {len(self.free_queue)} free")
        blocks = [self.free_queue.popleft() for _ in range(count)]
        for block in blocks:
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
                self.stats.evictions += 1
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take one more reference of each (a prefix hit or a fork); an evictable block leaves the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock], keep_cached: bool = True) -> None:
        """Drop one reference of each, in the given order: a block whose last reference drops joins the queue.

        Callers pass a block table reversed, so a sequence's tail is evicted before its head.
        `keep_cached=False` forgets the hashes of the blocks that become free (their contents are suspect).
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt:
                continue
            if block.block_hash is not None and not keep_cached:
                del self.cached[block.block_hash]
                block.block_hash = None
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a used, now full block under its hash; a hash already held by another block is left to it."""
        if self.enable_caching and block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block
