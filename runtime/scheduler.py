"""Sequences (a request's state as it moves through the engine) and the scheduler that runs them: continuous
batching under a token budget, decodes first, chunked prefill, preemption by recompute.

A sequence is waiting, running or finished (`SequenceStatus`: the scheduler's states). Each step spends at most
`max_num_batched_tokens` tokens on at most `max_num_seqs` sequences: running decodes first, then running prefill
chunks, then new admissions (FCFS, prefix hits first), so a long prompt is fed in block-aligned chunks and cannot
stall decodes. When a running
sequence needs a block and none is free or evictable, the lowest-priority running sequence (the
latest arrival, `running[-1]`) is preempted: its blocks are freed (they stay cached) and it returns
to the front of the waiting queue with its tokens, to be recomputed on readmission.
"""
from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .kv_cache_manager import CopyPairs, KVCacheManager
from .prompt_logprobs import PromptLogprobs
from .sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Tokens, cache position and block table of a request.

    `num_computed_tokens` counts tokens whose K/V are in the pool; the next step feeds
    tokens[num_computed_tokens : num_computed_tokens + chunk].
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # filled in prompt order while `wants_prompt_logprobs`
    first_scheduled_time: float | None = None  # perf_counter of the first step that fed it
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    rng: np.random.Generator | None = None
    # The sampler's logits processors keep what they track of this sequence here, by processor name.
    processor_state: dict[str, Any] = field(default_factory=dict)
    # Proposed tokens (speculative decoding) at the end of token_ids, fed with the last real token for the
    # target to verify; only within a step: runtime/spec/speculator.py adds them before scheduling and
    # removes them when the step's logits are in (or the sequence was not scheduled).
    num_draft_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.rng is None and not self.params.greedy:
            self.rng = np.random.default_rng(self.params.seed)
        if self.prompt_logprobs is None and self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no prefix to be predicted from

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True until every prompt token has its log-probability: until then each token fed needs a logits
        row of its own (the scheduler and packer make room) and the prefix cache is not read."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[self.num_tokens - self.num_draft_tokens:]

    @property
    def num_verified_tokens(self) -> int:
        """Tokens that are the sequence's own: the drafts excluded (only those may enter the prefix cache)."""
        return self.num_tokens - self.num_draft_tokens

    def set_drafts(self, draft: list[int]) -> None:
        self.drop_drafts()
        self.token_ids.extend(draft)
        self.num_draft_tokens = len(draft)

    def drop_drafts(self, keep: int = 0) -> None:
        """Remove the drafts after the first `keep`."""
        if self.num_draft_tokens > keep:
            del self.token_ids[self.num_tokens - self.num_draft_tokens + keep:]
            self.num_draft_tokens = keep

    @property
    def wants_token_rows(self) -> bool:
        """A logits row for every token fed this step: prompt logprobs, or drafts to verify."""
        return self.num_draft_tokens > 0 or self.wants_prompt_logprobs

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def _arrival(seq: Sequence) -> float:
    return seq.arrival


@dataclass
class ScheduledBatch:
    """One step's work, in packing order: multi-token chunks first, then single-token sequences.

    `copies` are (src, dst) block copies (copy-on-write) to run before the step's graph.
    """

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    copies: CopyPairs = field(default_factory=list)
    # Logits rows beyond one per sequence: every fed token but the last of each sequence that wants a row per
    # token (prompt logprobs, runtime/prompt_logprobs.py; drafts to verify, runtime/spec), in batch order after
    # the per-sequence rows.
    token_rows: int = 0
    # Every chunk fed as one-query rows over its sequence's block table, each a decode row (runtime/model_runner.py): a
    # draft model's catch-up, a few tokens that a decode gear computes for less than a prefill gear.
    decode_rows: bool = False

    @property
    def num_logits_rows(self) -> int:
        return len(self.seqs) + self.token_rows

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def add(self, seq: Sequence, n: int, copies: CopyPairs) -> None:
        """Feed `n` tokens of `seq` after the sequences already added (callers add in `packing_order`)."""
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.copies.extend(copies)


def packing_order(plan: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
    """(sequence, tokens fed) in packing order (docs/design.md, "The ordering rule"): chunks first, as given, then
    single tokens by context length, longest first, so the graph can split the decodes into two groups that each
    read what they use."""
    singles = sorted((e for e in plan if e[1] == 1), key=lambda e: -e[0].num_computed_tokens)
    return [e for e in plan if e[1] > 1] + singles


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 long_prefill_token_threshold: int | None = None, enable_chunked_prefill: bool = True,
                 max_logits_rows: int | None = None, batch_invariant: bool = False) -> None:
        """`long_prefill_token_threshold` caps one sequence's chunk per step (a multiple of block_size):
        smaller chunks keep the steps that carry a long prompt short for the decodes beside it.
        `enable_chunked_prefill=False` feeds every prompt whole in one step (the caller keeps each
        sequence within `max_num_batched_tokens`), as engines without chunked prefill do.
        `max_logits_rows` (default `max_num_seqs`) is the most logits rows one step's graph returns:
        it caps the chunks of sequences that want prompt logprobs, which need a row per token.
        `batch_invariant`: no prompt chunk of a single token (a chunk boundary or a prefix hit leaving one): the
        attention kernels compute a one-query step as a decode row and every row of a longer chunk as a prompt
        row, two different reductions (docs/performance.md, "Batch invariance")."""
        if not enable_chunked_prefill and long_prefill_token_threshold is not None:
            raise ValueError("long_prefill_token_threshold needs chunked prefill: set enable_chunked_prefill "
                             "to true, or drop long_prefill_token_threshold")
        if long_prefill_token_threshold is not None and (
                long_prefill_token_threshold < kv.block_size or long_prefill_token_threshold % kv.block_size):
            raise ValueError(f"long_prefill_token_threshold = {long_prefill_token_threshold}: must be a positive "
                             f"multiple of block_size ({kv.block_size})")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_cap = long_prefill_token_threshold or max_num_batched_tokens
        self.chunked_prefill = enable_chunked_prefill
        self.max_logits_rows = max_logits_rows or max_num_seqs
        self.batch_invariant = batch_invariant
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # by arrival: priority order, the last is preempted first
        self.num_preemptions = 0  # cumulative, for metrics

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` (a copy of `parent`'s tokens) beside it, sharing all of its blocks."""
        self.kv.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        bisect.insort(self.running, child, key=_arrival)

    def finish(self, seq: Sequence, keep_cached: bool = True) -> None:
        """Leave at once: the blocks are back in the pool before the next step.

        `keep_cached=False` (a failed step) forgets the hashes of the freed blocks: their K/V may be unwritten.
        """
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq, keep_cached)
        seq.status = SequenceStatus.FINISHED

    def _chunk(self, seq: Sequence, budget: int, start: int, rows: int) -> int:
        """Tokens to feed from `start`: all that remain if they fit, else a block-aligned prefix (or,
        without chunked prefill, none: the sequence waits for a step with room for all of it).

        A sequence that wants prompt logprobs feeds at most `rows` tokens (the logits rows left in the
        step), block-aligned when that is at least a block."""
        if rows < 1:  # every sequence needs its logits row
            return 0
        remaining = seq.num_tokens - start
        budget = min(budget, self.chunk_cap)
        wants_rows = seq.wants_token_rows
        if wants_rows:
            budget = min(budget, rows)
        if remaining <= budget:
            return remaining
        if not self.chunked_prefill:
            return 0
        aligned = budget - budget % self.kv.block_size
        n = budget if wants_rows and not aligned else aligned
        if self.batch_invariant and remaining - n == 1:  # never leave the prompt's last token alone
            n = n - self.kv.block_size if n > self.kv.block_size else n - 1
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens
        extra_rows = 0  # logits rows beyond one per planned sequence (prompt logprobs)
        plan: dict[Sequence, tuple[int, CopyPairs]] = {}
        preempted = False
        # Stable sort: decodes, then chunks, each in arrival order.
        for seq in sorted(self.running, key=lambda s: s.num_uncomputed > 1):
            if len(plan) == self.max_num_seqs:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._chunk(seq, budget, seq.num_computed_tokens, self.max_logits_rows - len(plan) - extra_rows)
            if n == 0:
                continue
            while (copies := self.kv.allocate_slots(seq, n)) is None:
                victim = self.running[-1]
                if victim in plan:  # scheduled earlier in this loop: give its tokens (and rows) back
                    given = plan.pop(victim)[0]
                    budget += given
                    if victim.wants_token_rows:
                        extra_rows -= given - 1
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if copies is not None:
                plan[seq] = (n, copies)
                budget -= n
                if seq.wants_token_rows:
                    extra_rows += n - 1
        # No preemption past this point, so the step's full blocks can be offered to admissions below.
        for seq, (n, _) in plan.items():
            self.kv.cache_blocks(seq, seq.num_computed_tokens + n)
        while self.waiting and not preempted and budget > 0 and len(self.running) < self.max_num_seqs \
                and len(plan) < self.max_num_seqs:
            seq = self.waiting[0]
            # Cached blocks would skip the rows whose logits prompt logprobs need (as vLLM does).
            hits = [] if seq.wants_prompt_logprobs else self.kv.computed_blocks(seq)
            if self.batch_invariant and hits and seq.num_tokens - len(hits) * self.kv.block_size == 1:
                hits.pop()  # recompute the last hit block with the last token: a chunk of one is a decode row
            n = self._chunk(seq, budget, len(hits) * self.kv.block_size,
                            self.max_logits_rows - len(plan) - extra_rows)
            if n == 0 or (copies := self.kv.allocate_slots(seq, n, hits)) is None:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_arrival)
            self.kv.cache_blocks(seq, seq.num_computed_tokens + n)
            plan[seq] = (n, copies)
            budget -= n
            if seq.wants_prompt_logprobs:
                extra_rows += n - 1
        if not plan:
            return None
        batch = ScheduledBatch(token_rows=extra_rows)
        for seq, n in packing_order([(seq, n) for seq, (n, _) in plan.items()]):
            batch.add(seq, n, plan[seq][1])
        return batch
