"""The KV cache manager: which blocks a sequence gets (prefix hits, fresh blocks, copy-on-write), over the pool
that owns them (vLLM v1's KVCacheManager and BlockPool: policy and mechanism, two classes).

The `BlockPool` holds the block records, their reference counts, the hash -> block map of cached full blocks and
the free queue. Every block but the null block (block 0, never handed out) is in exactly one state:
  free     ref_cnt == 0, no hash, in the free queue (handed out first);
  cached   ref_cnt == 0, hashed, in the free queue (reusable by a prefix hit, evictable in LRU order);
  used     ref_cnt > 0, not in the free queue (hashed or not).
So free + cached + used == num_blocks - 1, and no block is both queued and referenced.

The `KVCacheManager` decides: a sequence's `block_table` holds block ids (what the packer reads); the manager
keeps, per sequence, the hashes of its full blocks and how many of its blocks are registered in the cache. Each
full block's hash chains its parent's hash and its token ids, so a hash names the whole prefix up to the block's
end, and equal hashes mean equal K/V (same model, same positions). SHA-256 keeps accidental collisions, which
would silently serve another prompt's K/V, out of reach; the salt separates deployments that must not share
blocks (its digest is the root parent). The manager is the only one that computes them; the pool only maps them
to blocks.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterator, Protocol, Sequence as Tokens

from ..graphs.contract import NULL_BLOCK
from .kv_pools import KVPools

CopyPairs = list[tuple[int, int]]


class BlockHolder(Protocol):
    """What the manager reads and writes of a sequence (runtime/scheduler.py's `Sequence`): its tokens, the blocks that
    hold their K/V, and how many of them are computed."""

    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at admission

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_verified_tokens(self) -> int: ...  # the drafts excluded: only these enter the cache


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
        self._hashes: dict[BlockHolder, list[bytes]] = {}
        self._num_registered: dict[BlockHolder, int] = {}

    @classmethod
    def for_pools(cls, pools: KVPools, enable_prefix_caching: bool = True, salt: str = "") -> "KVCacheManager":
        """The manager of `pools`' blocks. The cache dtype is part of every block hash: blocks of two dtypes never
        match; `salt` separates deployments that must share no blocks."""
        return cls(pools.num_blocks, pools.block_size, enable_prefix_caching,
                   f"kv_cache_dtype={pools.kv_cache_dtype};".encode() + salt.encode())

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def usage(self) -> KVUsage:
        return KVUsage(self.pool.num_blocks - 1, self.pool.num_free, self.pool.num_cached)

    def _full_hashes(self, seq: BlockHolder, num_tokens: int) -> list[bytes]:
        hashes = self._hashes.setdefault(seq, [])
        extend_hashes(hashes, self._root, seq.token_ids, self.block_size, num_tokens // self.block_size)
        return hashes

    def computed_blocks(self, seq: BlockHolder) -> list[KVBlock]:
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

    def _needs_copy(self, seq: BlockHolder, start: int) -> bool:
        """True when the first token written this step lands in a partly filled block that others hold."""
        index = start // self.block_size
        return start % self.block_size != 0 and index < len(seq.block_table) \
            and self.pool.blocks[seq.block_table[index]].ref_cnt > 1

    def allocate_slots(self, seq: BlockHolder, num_new_tokens: int,
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

    def cache_blocks(self, seq: BlockHolder, num_tokens: int) -> None:
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

    def rollback(self, seq: BlockHolder, num_computed: int) -> None:
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

    def fork(self, parent: BlockHolder, child: BlockHolder) -> None:
        """`child` shares every block of `parent` (a copy of its tokens); writes copy shared partial blocks."""
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        self.pool.touch([self.pool.blocks[b] for b in child.block_table])
        if parent in self._hashes:
            self._hashes[child] = list(self._hashes[parent])
        self._num_registered[child] = self._num_registered.get(parent, 0)

    def free(self, seq: BlockHolder, keep_cached: bool = True) -> None:
        """Release the sequence's blocks tail first; `keep_cached=False` when their contents are suspect."""
        blocks = self.pool.blocks
        self.pool.free([blocks[b] for b in reversed(seq.block_table)], keep_cached)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._hashes.pop(seq, None)
        self._num_registered.pop(seq, None)

