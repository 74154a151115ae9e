"""Continuous batching under a token budget: decodes first, chunked prefill, preemption by recompute."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from runtime.kv_cache_manager import KVCacheManager
from runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step's work, in packing order: multi-token chunks first, then single-token sequences."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)


@dataclass
class SchedulerStats:
    preemptions: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Leave at once: the blocks are back in the pool before the next step."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens to feed now: all that remain if they fit, else a block-aligned prefix."""
        remaining = seq.num_uncomputed
        if remaining <= budget:
            return remaining
        return budget - budget % self.kv.block_size

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        multi = ScheduledBatch()
        single = ScheduledBatch()
        # Running sequences in arrival order, decodes before chunks; the latest arrival is preempted first.
        ordered = sorted(self.running, key=lambda s: s.num_uncomputed > 1)
        for seq in ordered:
            if seq not in self.running:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget)
            if n == 0:
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = next(s for s in reversed(self.running) if s not in multi.seqs and s not in single.seqs)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            target = multi if n > 1 else single
            target.seqs.append(seq)
            target.num_tokens.append(n)
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = self._chunk(seq, budget)
            if n == 0 or not self.kv.allocate_slots(seq, n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            target = multi if n > 1 else single
            target.seqs.append(seq)
            target.num_tokens.append(n)
            budget -= n
        if not multi.seqs and not single.seqs:
            return None
        return ScheduledBatch(multi.seqs + single.seqs, multi.num_tokens + single.num_tokens)
