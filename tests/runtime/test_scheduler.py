"""Scheduler: token budget, decodes first, block-aligned chunks, preemption by recompute, forks.

`drive` plays the engine against a fake model whose next token depends on every K/V slot a
sequence reads through its block table (kept by the shadow), so a wrong reuse, a missing
copy-on-write or a bad recompute changes the outputs.
"""
from __future__ import annotations

import random

import pytest

from pagedgraph.runtime.kv_cache_manager import KVCacheManager
from pagedgraph.runtime.scheduler import ScheduledBatch, Scheduler
from pagedgraph.runtime.scheduler import Sequence, SequenceStatus
from tests.runtime.kv_sim import Shadow, check_invariants, make_seq

pytestmark = pytest.mark.unit
BS = 4


def build(num_blocks: int, budget: int, max_seqs: int = 16, caching: bool = True,
          chunk_cap: int | None = None, chunked: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, caching), max_seqs, budget, chunk_cap, chunked)


def run_step(sched: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does after the graph: advance computed tokens, sample 0 for finished prompts."""
    for seq, n in zip(batch.seqs, batch.num_tokens):
        seq.num_computed_tokens += n
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(0)


def decoding(sched: Scheduler, count: int, prompt_len: int = 5) -> list[Sequence]:
    seqs = [make_seq(list(range(100 * i, 100 * i + prompt_len)), f"d{i}", arrival=i) for i in range(count)]
    for seq in seqs:
        sched.add(seq)
    while any(s.num_uncomputed != 1 or not s.output_token_ids for s in seqs):
        batch = sched.schedule()
        assert batch is not None
        run_step(sched, batch)
    return seqs


def test_decodes_first_then_a_block_aligned_chunk_and_packing_puts_chunks_first() -> None:
    sched = build(64, budget=20)
    decodes = decoding(sched, 3)
    long = make_seq(list(range(1000, 1100)), "long", arrival=10)
    sched.add(long)
    batch = sched.schedule()
    assert batch is not None
    assert batch.seqs == [long, *decodes] and batch.num_tokens == [16, 1, 1, 1]  # 17 left, aligned down to 16


def feed_beside(sched: Scheduler, decodes: list[Sequence], long: Sequence) -> list[tuple[int, int]]:
    """Run steps until `long`'s prompt is computed: its (start, size) chunks; every step keeps every decode."""
    sched.add(long)
    chunks = []
    while not long.output_token_ids:
        batch = sched.schedule()
        assert batch is not None and batch.total_tokens <= sched.max_num_batched_tokens
        assert set(decodes) <= set(batch.seqs), "a decode was stalled"
        if long in batch.seqs:
            chunks.append((long.num_computed_tokens, batch.num_tokens[batch.seqs.index(long)]))
        run_step(sched, batch)
    return chunks


def test_a_long_prompt_is_chunked_and_never_stalls_running_decodes() -> None:
    sched = build(2048, budget=256, max_seqs=17)
    decodes = decoding(sched, 16)
    long = make_seq(list(range(5000, 9000)), "long", arrival=100)
    chunks = feed_beside(sched, decodes, long)
    assert sum(n for _, n in chunks) == 4000
    assert all(start % BS == 0 and n % BS == 0 for start, n in chunks[:-1])
    assert max(n for _, n in chunks) == 240  # 256 - 16 decodes, a multiple of the block size


def test_the_latest_arrival_is_preempted_and_requeued_first_with_its_tokens() -> None:
    sched = build(5, budget=64)  # 4 usable blocks
    early = make_seq(list(range(7)), "early", arrival=0)
    late = make_seq(list(range(50, 57)), "late", arrival=1)
    queued = make_seq([9], "queued", arrival=2)
    for seq in (early, late, queued):
        sched.add(seq)
    run_step(sched, sched.schedule())  # both prompts (2 blocks each), queued waits for blocks
    assert sched.running == [early, late] and list(sched.waiting) == [queued]
    early.token_ids += [1]  # both now need a third block for their next decode
    late.token_ids += [2]
    early.num_computed_tokens = late.num_computed_tokens = 8
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [early]
    assert late.status is SequenceStatus.WAITING and list(sched.waiting) == [late, queued]
    assert late.token_ids == list(range(50, 57)) + [0, 2] and late.num_computed_tokens == 0 and not late.block_table
    assert sched.num_preemptions == 1


def test_a_victim_already_scheduled_this_step_is_unscheduled() -> None:
    sched = build(5, budget=64)
    chunked = make_seq(list(range(12)), "chunked", arrival=0)
    sched.add(chunked)
    run_step(sched, _only(sched, chunked, 4))  # first chunk: one block
    late = make_seq([7, 7, 7], "late", arrival=1)
    sched.add(late)
    batch = sched.schedule()  # late admitted (1 block), chunked continues (2 more): pool full
    assert batch is not None and set(batch.seqs) == {chunked, late}
    run_step(sched, batch)
    chunked.token_ids.append(5)  # chunked needs 1 more block; late is decoding in its own block
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [chunked] and late.status is SequenceStatus.WAITING


def _only(sched: Scheduler, seq: Sequence, n: int) -> ScheduledBatch:
    """Schedule just the first `n` tokens of `seq` (a budget of n for one step)."""
    budget, sched.max_num_batched_tokens = sched.max_num_batched_tokens, n
    batch = sched.schedule()
    sched.max_num_batched_tokens = budget
    assert batch is not None and batch.seqs == [seq] and batch.num_tokens == [n]
    return batch


def test_requests_admitted_in_one_step_share_the_prefix_computed_in_that_step() -> None:
    sched = build(64, budget=128)
    prefix = list(range(40))
    first, second = make_seq(prefix + [1], "a"), make_seq(prefix + [2, 3], "b")
    sched.add(first)
    sched.add(second)
    batch = sched.schedule()
    assert batch is not None and batch.num_tokens == [41, 2]
    assert second.num_cached_tokens == 40 and second.block_table[:10] == first.block_table[:10]


def test_no_admission_in_a_step_that_preempted_and_max_num_seqs_caps_the_batch() -> None:
    sched = build(64, budget=64, max_seqs=2)
    seqs = [make_seq([i] * 3, f"s{i}", arrival=i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = sched.schedule()
    assert batch is not None and batch.seqs == seqs[:2] and list(sched.waiting) == [seqs[2]]
    run_step(sched, batch)
    fork = make_seq(seqs[0].token_ids, "fork", arrival=0)
    sched.fork(seqs[0], fork)
    assert sched.running == [seqs[0], fork, seqs[1]]
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [seqs[0], fork]


# -- the engine loop against a fake model -----------------------------------------------------
def fake_next_token(context: list[int | None]) -> int:
    """Depends on every slot the sequence reads: any wrong K/V changes the output."""
    assert None not in context, "read a slot that was never written"
    return sum((i + 1) * (t + 1) for i, t in enumerate(context)) % 97  # type: ignore[operator]


def drive(requests: list[tuple[list[int], int]], num_blocks: int, budget: int, caching: bool = True,
          max_tokens: int = 12, max_seqs: int = 8) -> tuple[list[list[list[int]]], Scheduler]:
    """Run (prompt, n) requests to completion; returns each request's n output token lists."""
    sched = build(num_blocks, budget, max_seqs, caching)
    shadow = Shadow(num_blocks, BS)
    groups: list[list[Sequence]] = []
    for i, (prompt, _) in enumerate(requests):
        seq = make_seq(prompt, f"r{i}", arrival=i)
        groups.append([seq])
        sched.add(seq)
    owner = {g[0]: (g, n) for g, (_, n) in zip(groups, requests)}
    while sched.has_work():
        batch = sched.schedule()
        assert batch is not None, "deadlock: work left but nothing schedulable"
        assert batch.total_tokens <= budget and len(batch.seqs) <= max_seqs
        multi = [n > 1 for n in batch.num_tokens]
        assert multi == sorted(multi, reverse=True), "chunks must precede single tokens"
        shadow.copy(batch.copies)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed_tokens
            assert start + n == seq.num_tokens or (start % BS == 0 and n % BS == 0), "unaligned chunk"
            shadow.write(seq, start, n)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed_tokens += n
            shadow.check(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            group, want = owner[seq]
            ready = [seq]
            if len(group) < want:
                for k in range(1, want):
                    child = make_seq(seq.token_ids, f"{seq.request_id}/{k}", arrival=seq.arrival)
                    sched.fork(seq, child)
                    owner[child] = (group, want)
                    group.append(child)
                    ready.append(child)
            token = fake_next_token(shadow.read(seq, seq.num_tokens))
            for k, s in enumerate(ready):
                s.token_ids.append((token + group.index(s)) % 97)  # forks diverge from their first token
                if len(s.output_token_ids) == max_tokens:
                    sched.finish(s)
        check_invariants(sched.kv, [s for s in sched.running])
    assert sched.kv.num_free_blocks == num_blocks - 1, "blocks leaked"
    return [[s.output_token_ids for s in g] for g in groups], sched


def workload(seed: int = 7) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    system = [rng.randrange(97) for _ in range(37)]
    return [(system + [rng.randrange(97) for _ in range(rng.randrange(1, 30))], 1 + (i % 3 == 0))
            for i in range(12)]


def test_outputs_are_identical_with_caching_chunking_and_preemption() -> None:
    requests = workload()
    demand = sum(n * -(-(len(p) + 12) // BS) for p, n in requests)
    baseline, _ = drive(requests, num_blocks=demand + 1, budget=512, caching=False)
    cached, sched = drive(requests, num_blocks=demand + 1, budget=512)
    assert cached == baseline and sched.kv.stats.hits > 0
    chunked, _ = drive(requests, num_blocks=demand + 1, budget=16)
    assert chunked == baseline
    squeezed, sched = drive(requests, num_blocks=demand // 4 + 1, budget=512)
    assert squeezed == baseline and sched.num_preemptions > 0
    squeezed_off, sched = drive(requests, num_blocks=demand // 4 + 1, budget=64, caching=False)
    assert squeezed_off == baseline and sched.num_preemptions > 0
    assert any(len(set(map(tuple, g))) > 1 for g in baseline), "forks should diverge"


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    sched = build(256, budget=200, chunk_cap=12)
    decodes = decoding(sched, 2)
    long = make_seq(list(range(3000, 3050)), "long", arrival=10)
    assert [n for _, n in feed_beside(sched, decodes, long)] == [12, 12, 12, 12, 2]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_that_holds_it_whole() -> None:
    sched = build(256, budget=56, chunked=False)
    decodes = decoding(sched, 4)
    long = make_seq(list(range(3000, 3050)), "long", arrival=10)
    short = make_seq(list(range(4000, 4003)), "short", arrival=11)
    sched.add(long)
    sched.add(short)
    batch = sched.schedule()
    assert batch is not None and batch.seqs[0] is long and batch.num_tokens[0] == 50
    assert short not in batch.seqs, "FCFS: the next prompt does not jump the budget's remainder"
    run_step(sched, batch)
    sched.add(make_seq(list(range(5000, 5060)), "too-long-for-now", arrival=12))
    batch = sched.schedule()
    assert batch is not None and "too-long-for-now" not in [s.request_id for s in batch.seqs]
    assert batch.seqs[0] is short and batch.num_tokens[0] == 3 and set(decodes) < set(batch.seqs)


def test_chunk_cap_needs_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        build(16, budget=64, chunk_cap=16, chunked=False)


def test_long_prefill_token_threshold_must_be_block_aligned() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold = 10"):
        build(16, budget=64, chunk_cap=10)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_batch_invariant_never_feeds_a_prompt_token_alone(batch_invariant: bool) -> None:
    """A one-token prompt chunk runs as a decode row, which reduces differently (docs/performance.md, "Batch
    invariance"): batch-invariant scheduling lets neither a chunk boundary nor a prefix hit leave one."""
    kv = KVCacheManager(64, BS, True)
    sched = Scheduler(kv, 16, 8, batch_invariant=batch_invariant)
    prompt = list(range(500, 509))  # 9 tokens: chunks of 8 would leave the ninth alone
    first = make_seq(prompt, "first", arrival=0)
    sched.add(first)
    chunks = []
    while not first.output_token_ids:
        batch = sched.schedule()
        assert batch is not None
        chunks.append(batch.num_tokens[0])
        run_step(sched, batch)
    sched.finish(first)
    again = make_seq(prompt, "again", arrival=1)  # two of its blocks are cached: a hit of 8 leaves one token
    sched.add(again)
    batch = sched.schedule()
    assert batch is not None and batch.seqs == [again]
    if batch_invariant:
        assert chunks == [4, 5] and again.num_computed_tokens == 4 and batch.num_tokens == [5]
    else:
        assert chunks == [8, 1] and again.num_computed_tokens == 8 and batch.num_tokens == [1]
