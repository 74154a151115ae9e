"""Block pool and KV cache manager: free queue, hash chain, prefix reuse, LRU eviction, copy-on-write.

The randomized test drives the manager as the engine does (admit with prefix hits, compute
chunks, decode, fork, free) against a shadow of the pool's contents: after every operation the
pool's invariants hold and every sequence's computed tokens are what its blocks hold.
"""
from __future__ import annotations

import random

import pytest

from pagedgraph.graphs.contract import NULL_BLOCK
from pagedgraph.runtime.kv_cache_manager import BlockPool, FreeBlockQueue, KVBlock
from pagedgraph.runtime.kv_cache_manager import KVCacheManager, block_hash, extend_hashes, root_hash
from pagedgraph.runtime.scheduler import Sequence
from tests.runtime.kv_sim import Shadow, check_invariants, make_seq

pytestmark = pytest.mark.unit
BS = 4

def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


# -- free queue and pool ---------------------------------------------------------------------
def test_free_queue_is_a_doubly_linked_list_with_o1_removal() -> None:
    queue = FreeBlockQueue()
    blocks = [KVBlock(i) for i in range(5)]
    for b in blocks[1:]:
        queue.append(b)
    queue.appendleft(blocks[0])
    assert ids(list(queue)) == [0, 1, 2, 3, 4]
    queue.remove(blocks[2])
    queue.remove(blocks[4])
    assert ids(list(queue)) == [0, 1, 3] and len(queue) == 3
    assert queue.popleft() is blocks[0]
    assert ids(list(queue)) == [1, 3]
    queue.popleft(), queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()


def test_pool_never_hands_out_the_null_block_and_reports_shortage() -> None:
    pool = BlockPool(5)
    got = pool.allocate(4)
    assert NULL_BLOCK not in ids(got) and all(b.ref_cnt == 1 for b in got)
    with pytest.raises(MemoryError, match="asked for 1 blocks, 0 free"):
        pool.allocate(1)
    with pytest.raises(ValueError, match="num_blocks = 1"):
        BlockPool(1)


def test_cached_blocks_are_evicted_lru_and_only_when_a_fresh_block_is_needed() -> None:
    pool = BlockPool(7)
    a = pool.allocate(3)
    b = pool.allocate(2)
    for i, block in enumerate(a + b):
        pool.cache(block, bytes([i]))
    pool.free(list(reversed(a)))  # a's tail first: a2, a1, a0
    pool.free(list(reversed(b)))
    assert pool.num_free == 6 and pool.stats.evictions == 0
    (fresh,) = pool.allocate(1)  # the never-used block goes first: no eviction
    assert fresh.block_id == 6 and pool.stats.evictions == 0
    evicted = pool.allocate(2)
    assert ids(evicted) == [a[2].block_id, a[1].block_id]  # a finished request's tail goes first
    assert pool.stats.evictions == 2
    assert pool.lookup(bytes([2])) is None and pool.lookup(bytes([0])) is a[0]


def test_reused_cached_block_leaves_the_queue_and_unhashed_free_blocks_go_first() -> None:
    pool = BlockPool(4)
    x, y, z = pool.allocate(3)
    pool.cache(x, b"x")
    pool.free([x, y, z])
    assert ids(list(pool.free_queue)) == [z.block_id, y.block_id, x.block_id]
    pool.touch([x])  # a prefix hit on a free cached block
    assert x.ref_cnt == 1 and x not in list(pool.free_queue) and pool.num_free == 2
    pool.free([x], keep_cached=False)
    assert x.block_hash is None and pool.lookup(b"x") is None


def test_a_hash_already_cached_stays_with_its_first_block() -> None:
    pool = BlockPool(4)
    x, y = pool.allocate(2)
    pool.cache(x, b"h")
    pool.cache(y, b"h")
    assert pool.lookup(b"h") is x and y.block_hash is None
    off = BlockPool(4, enable_caching=False)
    (w,) = off.allocate(1)
    off.cache(w, b"h")
    assert off.lookup(b"h") is None


# -- hash chain -------------------------------------------------------------------------------
def test_hash_chain_names_the_whole_prefix_and_the_salt() -> None:
    root = root_hash(b"")
    h1 = block_hash(root, [1, 2, 3, 4])
    assert h1 == block_hash(root, [1, 2, 3, 4])
    assert h1 != block_hash(root, [1, 2, 3, 5])
    assert block_hash(h1, [5, 6, 7, 8]) != block_hash(block_hash(root, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert block_hash(root_hash(b"tenant-a"), [1, 2, 3, 4]) != h1
    tokens = list(range(11))
    at_once: list[bytes] = []
    extend_hashes(at_once, root, tokens, BS, 2)
    grown: list[bytes] = []
    extend_hashes(grown, root, tokens, BS, 1)
    extend_hashes(grown, root, tokens, BS, 2)
    assert grown == at_once == [block_hash(root, tokens[:4]), block_hash(at_once[0], tokens[4:8])]


# -- manager: reuse, copy-on-write ------------------------------------------------------------
def compute(kv: KVCacheManager, seq: Sequence, n: int | None = None) -> list[tuple[int, int]]:
    """Admit/extend `seq` by `n` tokens (all uncomputed by default), as a scheduler step does."""
    hits = kv.computed_blocks(seq)
    n = seq.num_tokens - seq.num_computed_tokens - len(hits) * BS if n is None else n
    copies = kv.allocate_slots(seq, n, hits)
    assert copies is not None
    kv.cache_blocks(seq, seq.num_computed_tokens + n)
    seq.num_computed_tokens += n
    return copies


def test_longest_cached_prefix_is_reused_leaving_the_last_token() -> None:
    kv = KVCacheManager(16, BS)
    first = make_seq(list(range(10)))
    compute(kv, first)
    kv.free(first)
    again = make_seq(list(range(10)))
    hits = kv.computed_blocks(again)
    assert ids(hits) == first_blocks(kv, range(10))[:2]
    exact = make_seq(list(range(8)))  # two full blocks cached, but the last token must be computed
    assert len(kv.computed_blocks(exact)) == 1
    other = make_seq([0, 1, 2, 3, 99, 5, 6, 7, 8])
    assert len(kv.computed_blocks(other)) == 1  # diverges in block 1
    compute(kv, again)
    assert again.num_cached_tokens == 8 and kv.stats.hits == 8 and kv.stats.queries == 20


def first_blocks(kv: KVCacheManager, tokens: range) -> list[int]:
    """Block ids the cache holds for the full blocks of `tokens`, in order."""
    hashes: list[bytes] = []
    extend_hashes(hashes, root_hash(b""), list(tokens), BS, len(tokens) // BS)
    return [kv.pool.lookup(h).block_id for h in hashes]  # type: ignore[union-attr]


def test_prefix_caching_off_never_reuses() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=False)
    first = make_seq(list(range(10)))
    compute(kv, first)
    kv.free(first)
    assert kv.computed_blocks(make_seq(list(range(10)))) == [] and not kv.pool.cached


def test_fork_shares_blocks_and_the_first_write_into_a_shared_partial_block_copies_it() -> None:
    kv = KVCacheManager(16, BS)
    parent = make_seq(list(range(6)))  # blocks: [0..3] full, [4, 5] partial
    compute(kv, parent)
    child = make_seq(list(range(6)), "child")
    kv.fork(parent, child)
    assert child.block_table == parent.block_table
    assert [kv.pool.blocks[b].ref_cnt for b in parent.block_table] == [2, 2]
    parent.token_ids.append(7)
    child.token_ids.append(8)
    shared_tail = parent.block_table[1]
    copies = compute(kv, parent, 1)
    assert copies == [(shared_tail, parent.block_table[1])] and parent.block_table[1] != shared_tail
    assert parent.block_table[0] == child.block_table[0]  # the full block stays shared
    assert compute(kv, child, 1) == []  # now the only holder: written in place
    assert child.block_table[1] == shared_tail


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(3, BS)
    seq = make_seq(list(range(9)))
    assert kv.allocate_slots(seq, 9) is None
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and kv.num_free_blocks == 2


# -- randomized: invariants and contents after every operation --------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_randomized_operations_keep_the_pool_consistent(caching: bool) -> None:
    rng = random.Random(1234)
    num_blocks = 48
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, salt=b"test")
    shadow = Shadow(num_blocks, BS)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live: list[Sequence] = []
    counts = dict.fromkeys(["admit", "hit", "chunk", "decode", "fork", "cow", "free", "evict", "full"], 0)
    for step in range(4000):
        op = rng.random()
        if op < 0.25 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            seq = make_seq(tokens, f"s{step}")
            hits = kv.computed_blocks(seq)
            n = rng.randrange(1, seq.num_tokens - len(hits) * BS + 1)
            copies = kv.allocate_slots(seq, n, hits)
            if copies is None:
                counts["full"] += 1
                assert seq.block_table == []
            else:
                counts["admit"] += 1
                counts["hit"] += bool(hits)
                shadow.write(seq, seq.num_computed_tokens, n)
                kv.cache_blocks(seq, seq.num_computed_tokens + n)
                seq.num_computed_tokens += n
                live.append(seq)
        elif op < 0.65:
            seq = rng.choice(live)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(rng.randrange(50))
                counts["decode"] += 1
            else:
                counts["chunk"] += 1
            start = seq.num_computed_tokens
            n = rng.randrange(1, seq.num_tokens - start + 1)
            evictions = kv.stats.evictions
            copies = kv.allocate_slots(seq, n)
            if copies is None:  # as the scheduler would: preempt by recompute
                kv.free(seq)
                live.remove(seq)
            else:
                counts["cow"] += bool(copies)
                counts["evict"] += kv.stats.evictions > evictions
                shadow.copy(copies)
                shadow.write(seq, start, n)
                kv.cache_blocks(seq, start + n)
                seq.num_computed_tokens += n
        elif op < 0.75:
            parent = rng.choice(live)
            if parent.num_computed_tokens == parent.num_tokens:
                child = make_seq(parent.token_ids, f"{parent.request_id}/fork{step}")
                kv.fork(parent, child)
                live.append(child)
                counts["fork"] += 1
        else:
            seq = live.pop(rng.randrange(len(live)))
            kv.free(seq, keep_cached=rng.random() < 0.9)
            counts["free"] += 1
        check_invariants(kv, live)
        for seq in live:
            shadow.check(seq)
    for seq in live:
        kv.free(seq)
    check_invariants(kv, [])
    assert kv.num_free_blocks == num_blocks - 1
    assert all(counts[k] > 50 for k in ("admit", "chunk", "decode", "fork", "cow", "free", "full")), counts
    if caching:
        assert counts["hit"] > 50 and counts["evict"] > 20, counts
    else:
        assert counts["hit"] == 0 and not kv.pool.cached
