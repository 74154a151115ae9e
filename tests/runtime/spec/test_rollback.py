"""Rolling back rejected drafts leaves the KV manager as a run that never proposed them: same block tables'
lengths and refcounts, same prefix-cache hashes, same free count (no model: the manager alone)."""
from __future__ import annotations

import pytest

from pagedgraph.runtime.kv_cache_manager import KVCacheManager
from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.scheduler import Sequence

pytestmark = pytest.mark.unit
BS = 16


def _state(kv: KVCacheManager, seqs: list[Sequence]) -> tuple:
    refs = [[kv.pool.blocks[b].ref_cnt for b in s.block_table] for s in seqs]
    return kv.num_free_blocks, set(kv.pool.cached), refs, [s.num_computed_tokens for s in seqs]


def _speculate() -> tuple:
    """Two forks of a 30-token prompt decode 40 steps each; each step feeds 5 drafts of which the target keeps
    a varying number (0-3), then one token of its own."""
    kv = KVCacheManager(64, BS)
    params = SamplingParams(temperature=0)
    parent = Sequence("r", list(range(100, 130)), params, 0.0)
    assert kv.allocate_slots(parent, 30) == []
    kv.cache_blocks(parent, 30)
    parent.num_computed_tokens = 30
    parent.token_ids.append(7)
    child = Sequence("r", parent.prompt_token_ids, params, 0.0, token_ids=list(parent.token_ids))
    kv.fork(parent, child)
    stream = iter(range(1000, 1000 + 400))
    for step in range(40):
        for seq in (parent, child):
            kept = [next(stream) for _ in range(step % 4)]
            start = seq.num_computed_tokens
            seq.set_drafts(kept + [1, 2, 3, 4, 5][:5 - len(kept)])
            copies = kv.allocate_slots(seq, seq.num_uncomputed)
            assert copies is not None
            kv.cache_blocks(seq, start + seq.num_uncomputed)
            seq.drop_drafts()
            kv.rollback(seq, start + 1 + len(kept))
            for token in kept:  # as the engine appends them
                kv.cache_blocks(seq, seq.num_tokens)
                seq.token_ids.append(token)
            kv.cache_blocks(seq, seq.num_tokens)
            seq.token_ids.append(next(stream))
    return kv, parent, child


def test_rollback_matches_a_run_without_drafts() -> None:
    """Both runs see the same token streams: the speculative one takes several per step."""
    spec_kv, *spec = _speculate()
    plain_kv, *plain = _replay([s.token_ids for s in spec])
    assert _state(spec_kv, spec) == _state(plain_kv, plain)
    for kv, seqs in ((spec_kv, spec), (plain_kv, plain)):
        for seq in seqs:
            kv.free(seq)
    assert spec_kv.num_free_blocks == plain_kv.num_free_blocks == 63
    assert set(spec_kv.pool.cached) == set(plain_kv.pool.cached)


def _replay(streams: list[list[int]]) -> tuple:
    """The same two sequences decoded one token per step (no drafts) to the same tokens."""
    kv = KVCacheManager(64, BS)
    params = SamplingParams(temperature=0)
    parent = Sequence("r", streams[0][:30], params, 0.0)
    kv.allocate_slots(parent, 30)
    kv.cache_blocks(parent, 30)
    parent.num_computed_tokens = 30
    parent.token_ids.append(streams[0][30])
    child = Sequence("r", parent.prompt_token_ids, params, 0.0, token_ids=list(parent.token_ids))
    kv.fork(parent, child)
    for seq, stream in ((parent, streams[0]), (child, streams[1])):
        while seq.num_tokens < len(stream):
            kv.allocate_slots(seq, 1)
            kv.cache_blocks(seq, seq.num_computed_tokens + 1)
            seq.num_computed_tokens += 1
            seq.token_ids.append(stream[seq.num_tokens])
    return kv, parent, child


def test_drafts_of_a_whole_block_leave_no_hash_behind() -> None:
    """K >= block_size: the step that completes a verified block also holds a block of drafts only. After those
    drafts are rejected and other tokens fill that block, a prompt that repeats the drafts must not hit it."""
    kv = KVCacheManager(16, BS)
    params = SamplingParams(temperature=0)
    seq = Sequence("a", list(range(100, 132)), params, 0.0)
    kv.allocate_slots(seq, 31)
    kv.cache_blocks(seq, 31)
    seq.num_computed_tokens = 31
    drafts = list(range(500, 500 + BS))
    seq.set_drafts(drafts)
    assert kv.allocate_slots(seq, 1 + BS) == []
    kv.cache_blocks(seq, 32 + BS)
    seq.drop_drafts()
    kv.rollback(seq, 32)
    for token in range(600, 600 + BS):  # what the target emits instead, one plain step each
        kv.cache_blocks(seq, seq.num_tokens)
        seq.token_ids.append(token)
    kv.allocate_slots(seq, BS)
    seq.num_computed_tokens = 32 + BS
    kv.cache_blocks(seq, seq.num_tokens)
    repeats_drafts = Sequence("b", seq.token_ids[:32] + drafts + [1], params, 1.0)
    assert len(kv.computed_blocks(repeats_drafts)) == 2
    follows = Sequence("c", seq.token_ids + [1], params, 2.0)
    assert len(kv.computed_blocks(follows)) == 3
