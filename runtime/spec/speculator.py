"""One engine step of speculative decoding, around the scheduler: propose, trim to what was scheduled, verify.

Drafts ride in the sequence's own token list (`Sequence.set_drafts`), so the scheduler sizes and allocates the
K+1 tokens like any chunk, the packer feeds them with a logits row each, and the prefix cache skips them
(`num_verified_tokens`). After the step the kept tokens are appended as the sampler's would be and the rejected
drafts' slots are rolled back (KVCacheManager.rollback): the engine does both.

Speculation is turned down where it does not pay:
- per sequence, by the proposer where it sizes its drafts itself (`Proposer.sizes_drafts`: n-gram lookup, from what
  drafts of its match's length kept); otherwise
- per sequence: the number proposed follows what the last verification kept (all kept: one more, up to K;
  else what was kept, plus one), and after `MISSES` verifications in a row that kept nothing the sequence
  pauses, for twice as many steps each time;
- per sequence, where proposals cost (a draft model: `Proposer.cost`, a proposed token in target decode steps):
  with a the sequence's recent acceptance per drafted position, k drafts give 1 + a + ... + a^k tokens for
  one verification and k draft tokens, 1 + k * cost decode steps' worth (a verification taken as one step). The
  sequence proposes the k that gives most tokens per step, and pauses as above when no k beats a plain decode,
  then tries one draft to measure again, until pauses pass LAST_PROBE steps; so a draft that rarely agrees with
  the target costs little;
- per step, by default: the step's tokens (one per running sequence plus the drafts) stay within
  STEP_TOKENS (or K+1, if larger), shared out in arrival order, so a verification costs a small gear's step
  and a large batch, compute-bound already, does not speculate (docs/performance.md, "Speculative decoding":
  a T=8 step against a decode step); with vLLM's `disable_by_batch_size` set, that rule instead: every
  sequence speculates up to that many running, none above.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

import numpy as np

from ..scheduler import ScheduledBatch, Sequence
from ..structured_output import StructuredOutputs
from .config import SpeculativeConfig
from .proposer import Proposer
from .rejection import accept_greedy, accept_one, accept_sampled, sample_last

STEP_TOKENS = 8  # a speculating step's tokens at most, unless disable_by_batch_size is set
MISSES = 2  # verifications in a row that kept nothing before a sequence pauses
FIRST_PAUSE = 4  # steps; doubled at each pause of the same sequence, reset when a draft is kept
# A sequence's acceptance: kept drafts over drafted positions tried (a position after a rejection is not tried),
# each verification's counts weighted 1 and older ones MEMORY times less per verification; before its first
# verification it counts PRIOR positions with PRIOR_RATE kept, so a proposal is tried.
MEMORY, PRIOR, PRIOR_RATE = 0.8, 4.0, 0.75
# Paused for its cost, a sequence tries one draft after each pause while pauses are this short, then no more: a
# draft with a pool of its own must first take in the tokens since its last proposal (runtime/spec/draft.py), about
# a prefill of them.
LAST_PROBE = 64


@dataclass
class SpecDecodeStats:
    """Cumulative counters with vLLM's spec_decode meanings (a draft: one proposal of >= 1 tokens)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]: drafts kept at each position

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification, the bonus token included (vLLM's mean acceptance length)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def since(self, before: dict[str, Any]) -> dict[str, Any]:
        """The counters since `before` (an earlier `to_dict`), with their rates, as `to_dict` gives them."""
        delta = SpecDecodeStats(self.num_drafts - before["num_drafts"],
                                self.num_draft_tokens - before["num_draft_tokens"],
                                self.num_accepted_tokens - before["num_accepted_tokens"],
                                [a - b for a, b in zip(self.accepted_per_pos, before["accepted_per_pos"])])
        return delta.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos),
                "acceptance_rate": self.acceptance_rate, "mean_acceptance_length": self.mean_acceptance_length}


@dataclass
class _Pace:
    """A sequence's adaptive proposal length."""

    k: int
    misses: int = 0
    paused: int = 0  # steps left without proposals
    pause: int = FIRST_PAUSE
    kept: float = PRIOR * PRIOR_RATE  # decayed counts of the acceptance
    tried: float = PRIOR
    probe: bool = False  # paused for its cost: one draft after the pause measures the acceptance again

    def best_length(self, cost: float) -> int:
        """The k <= self.k giving the most tokens per decode step's worth of work; 0 if none beats one token."""
        rate = self.kept / self.tried
        best, best_gain, tokens, term = 0, 1.0, 1.0, 1.0
        for k in range(1, self.k + 1):
            term *= rate
            tokens += term
            gain = tokens / (1 + k * cost)
            if gain > best_gain:
                best, best_gain = k, gain
        return best


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int, vocab_size: int,
                 eligible: Callable[[Sequence], bool], grammars: StructuredOutputs | None = None) -> None:
        """`eligible`: a sequence whose rows need no logits processor but `grammars` (penalties would have to be
        replayed per position). A constrained sequence's drafts are cut to what its grammar allows, and each
        verified position is masked by the grammar after the tokens kept before it."""
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.eligible = eligible
        self.grammars = grammars
        self.batch_limit = config.disable_by_batch_size
        self.step_tokens = max(STEP_TOKENS, self.k + 1) if self.batch_limit is None else None
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * self.k)
        self._pace: dict[Sequence, _Pace] = {}
        self._proposed: list[Sequence] = []
        self._scratch = np.empty(vocab_size, np.float64)
        self._rows = np.empty((self.k + 1, vocab_size), np.float32)
        self._masked = np.empty((1, vocab_size), np.float32)  # one constrained position's row, masked

    def rows(self, logits: np.ndarray, picks: list[int]) -> np.ndarray:
        """The logits rows of one verification, gathered into a buffer made once."""
        out = self._rows[:len(picks)]
        np.take(logits, picks, axis=0, out=out)
        return out

    def _length(self, seq: Sequence) -> int:
        """Tokens to propose for `seq` now (0: none)."""
        left = seq.params.max_tokens - (seq.num_tokens - seq.num_prompt_tokens)  # the step emits up to k + 1
        room = min(left - 1, self.max_model_len - seq.num_tokens - 1)
        if self.proposer.sizes_drafts:
            return max(0, min(self.k, room))
        pace = self._pace.get(seq)
        if pace is None:
            pace = self._pace[seq] = _Pace(self.k)
        if pace.paused:
            pace.paused -= 1
            return 0
        cost = self.proposer.cost
        k = pace.best_length(cost) if cost else pace.k
        if pace.probe:
            k, pace.probe = 1, False
        elif not k:
            self._pause(pace)
            pace.probe = pace.pause <= LAST_PROBE
            return 0
        return max(0, min(k, room))

    def propose(self, running: Seq[Sequence]) -> None:
        """Give drafts to the running sequences that decode next (one token left to compute)."""
        self._proposed = []
        if self.batch_limit is not None and len(running) > self.batch_limit:
            return
        if self.step_tokens is not None and len(running) >= self.step_tokens:
            return
        seqs = [s for s in running if s.num_uncomputed == 1 and self.eligible(s)]
        budget = len(seqs) * self.k if self.step_tokens is None else self.step_tokens - len(running)
        lengths = []
        for seq in seqs:
            length = min(self._length(seq), budget)
            lengths.append(length)
            budget -= length
        for seq, draft in zip(seqs, self.proposer.propose(seqs, lengths)):
            if draft and self._constrained(seq):
                del draft[self.grammars.valid_prefix(seq, draft):]  # type: ignore[union-attr]
            if draft:
                seq.set_drafts(draft)
                self._proposed.append(seq)

    def scheduled(self, batch: ScheduledBatch | None) -> None:
        """Keep the drafts the step feeds (a budget may have cut a sequence's chunk), drop the others."""
        fed = dict(zip(batch.seqs, batch.num_tokens)) if batch is not None else {}
        for seq in self._proposed:
            seq.drop_drafts(keep=fed.get(seq, 1) - 1)

    def verify(self, seq: Sequence, rows: np.ndarray) -> list[int]:
        """The tokens `seq` keeps from its verification rows ([drafts + 1, vocab], one per fed token); its drafts
        are dropped from its tokens (the caller appends these and rolls the cache back)."""
        drafts = seq.draft_token_ids
        seq.drop_drafts()
        params = seq.params
        if self._constrained(seq):
            tokens = self._verify_constrained(seq, rows, drafts)
        elif params.greedy:
            tokens = accept_greedy(rows, drafts)
        else:
            assert seq.rng is not None
            tokens = accept_sampled(rows, drafts, self.proposer.draft_probs(seq), params, seq.rng, self._scratch)
        kept = len(tokens) - 1
        self._count(kept, len(drafts))
        pace = self._pace.get(seq)
        if pace is not None:  # paced by the speculator (not a proposer that sizes its drafts)
            pace.kept = pace.kept * MEMORY + kept
            pace.tried = pace.tried * MEMORY + kept + (kept < len(drafts))
            self._adapt(pace, kept)
        return tokens

    def _count(self, kept: int, drafted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += kept
        for pos in range(kept):
            stats.accepted_per_pos[pos] += 1

    def _constrained(self, seq: Sequence) -> bool:
        return self.grammars is not None and self.grammars.wants(seq)

    def _verify_constrained(self, seq: Sequence, rows: np.ndarray, drafts: list[int]) -> list[int]:
        """Position by position: mask the row by the grammar, choose, advance the grammar by the token emitted."""
        grammars = self.grammars
        assert grammars is not None
        q = None if seq.params.greedy else self.proposer.draft_probs(seq)
        out = []
        for j in range(len(drafts) + 1):
            row = self._masked
            np.copyto(row[0], rows[j])
            grammars.apply(row, [seq])
            if j < len(drafts):
                token, kept = accept_one(row[0], drafts[j], None if q is None else q[j], seq.params, seq.rng,
                                         self._scratch)
            else:
                token, kept = sample_last(row[0], seq.params, seq.rng, self._scratch), False
            grammars.accepted(seq, token)
            out.append(token)
            state = grammars.state(seq)
            if not kept or state.complete or state.error is not None:
                break
        grammars.rollback(seq, len(out))  # `emitted` advances it again, token by token, as the engine appends
        return out

    def emitted(self, seq: Sequence, token: int) -> None:
        """`token` of the last verification is being appended to `seq` (the sampler's `accepted`, in order)."""
        if self._constrained(seq):
            self.grammars.accepted(seq, token)  # type: ignore[union-attr]

    def _adapt(self, pace: _Pace, kept: int) -> None:
        pace.k = min(self.k, kept + 1)
        if kept:
            pace.misses = 0
            # A kept probe of a draft that does not pay leaves the pause as it is.
            if not self.proposer.cost or pace.best_length(self.proposer.cost):
                pace.pause = FIRST_PAUSE
            return
        pace.misses += 1
        if pace.misses >= MISSES:
            self._pause(pace)

    @staticmethod
    def _pause(pace: _Pace) -> None:
        pace.paused, pace.pause, pace.misses = pace.pause, pace.pause * 2, 0

    def release(self, seq: Sequence) -> None:
        self._pace.pop(seq, None)
        self.proposer.release(seq)
