"""Per-sequence changes to a logits row before a token is chosen: the `LogitsProcessor` interface and the
built-in `Penalties` (min_tokens, logit_bias, repetition, frequency and presence penalties).

The sampler copies only the rows of sequences some processor wants into its own buffer, so a batch
that uses none of them pays nothing; a processor edits those rows in place and keeps what it knows
about a sequence in `seq.processor_state[its name]`, updated by `accepted` as each token is chosen.
Grammar masks (structured output) plug in as one more processor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence as Seq

import numpy as np

from .scheduler import Sequence


class LogitsProcessor(Protocol):
    name: str  # its key in seq.processor_state and in the sampler's per-processor seconds

    def wants(self, seq: Sequence) -> bool:
        """Whether this step's row of `seq` needs this processor (cheap: asked for every row of every step)."""

    def apply(self, rows: np.ndarray, seqs: Seq[Sequence]) -> None:
        """Edit rows[i] (float32, writable, the sampler's copy) for seqs[i] in place; skip seqs it does not want."""

    def accepted(self, seq: Sequence, token: int) -> None:
        """`token` was chosen for `seq` (called for the sequences `wants` said yes to this step)."""


@dataclass
class PenaltyState:
    """One sequence's token statistics, built once from its tokens and then updated per chosen token.

    `additive` holds -(count * frequency_penalty + presence_penalty) for every output token, so one
    vector add applies both penalties; `seen` marks prompt and output tokens for repetition_penalty.
    """

    num_output: int
    counts: dict[int, int]  # output token -> occurrences
    additive: np.ndarray | None  # float32 [vocab]; None when both penalties are 0
    seen: np.ndarray | None  # bool [vocab]; None when repetition_penalty is 1
    blocked: np.ndarray  # ids masked while num_output < min_tokens: EOS (unless ignore_eos) and stop_token_ids
    bias_ids: np.ndarray
    bias_values: np.ndarray  # float32, aligned with bias_ids
    bias_scratch: np.ndarray


class Penalties:
    """vLLM's order: min_tokens mask, logit_bias, repetition_penalty, then frequency and presence (OpenAI)."""

    name = "penalties"

    def __init__(self, vocab_size: int, eos_token_ids: Seq[int]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        # Shared by every row: which logits the repetition penalty divides, and which it multiplies.
        self._positive = np.empty(vocab_size, np.bool_)
        self._negative = np.empty(vocab_size, np.bool_)

    def wants(self, seq: Sequence) -> bool:
        p = seq.params
        return bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1
                    or seq.num_tokens - seq.num_prompt_tokens < p.min_tokens)

    def state(self, seq: Sequence) -> PenaltyState:
        """Built on a sequence's first processed step (a fork builds its own from the tokens it copied)."""
        state = seq.processor_state.get(self.name)
        if state is None:
            p = seq.params
            blocked = (() if p.ignore_eos else self.eos_token_ids) + p.stop_token_ids
            bias = p.logit_bias or {}
            state = PenaltyState(
                num_output=0, counts={},
                additive=np.zeros(self.vocab_size, np.float32) if p.presence_penalty or p.frequency_penalty else None,
                seen=np.zeros(self.vocab_size, np.bool_) if p.repetition_penalty != 1 else None,
                blocked=np.array(sorted(set(blocked)), np.int64),
                bias_ids=np.fromiter(bias.keys(), np.int64, len(bias)),
                bias_values=np.fromiter(bias.values(), np.float32, len(bias)),
                bias_scratch=np.empty(len(bias), np.float32))
            if state.seen is not None:
                state.seen[seq.prompt_token_ids] = True
            seq.processor_state[self.name] = state
            for token in seq.output_token_ids:
                self._count(state, p.presence_penalty, p.frequency_penalty, token)
        return state

    def apply(self, rows: np.ndarray, seqs: Seq[Sequence]) -> None:
        for row, seq in zip(rows, seqs):
            if not self.wants(seq):
                continue
            p, state = seq.params, self.state(seq)
            if state.num_output < p.min_tokens:
                row[state.blocked] = -np.inf
            if state.bias_ids.size:
                np.take(row, state.bias_ids, out=state.bias_scratch)
                state.bias_scratch += state.bias_values
                row[state.bias_ids] = state.bias_scratch
            if state.seen is not None:
                penalty = np.float32(p.repetition_penalty)
                np.greater(row, 0, out=self._positive)
                np.logical_not(self._positive, out=self._negative)
                self._positive &= state.seen
                self._negative &= state.seen
                np.divide(row, penalty, out=row, where=self._positive)
                np.multiply(row, penalty, out=row, where=self._negative)
            if state.additive is not None:
                row += state.additive

    def accepted(self, seq: Sequence, token: int) -> None:
        p = seq.params
        self._count(self.state(seq), p.presence_penalty, p.frequency_penalty, token)

    @staticmethod
    def _count(state: PenaltyState, presence: float, frequency: float, token: int) -> None:
        state.num_output += 1
        count = state.counts[token] = state.counts.get(token, 0) + 1
        if state.additive is not None:
            state.additive[token] = -(count * frequency + presence)
        if state.seen is not None:
            state.seen[token] = True
