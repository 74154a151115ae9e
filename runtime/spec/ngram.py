"""N-gram prompt lookup (vLLM's `ngram`): the tokens that followed the latest earlier occurrence of the
sequence's longest matching suffix, at least `prompt_lookup_min` tokens long.

Costs nothing when nothing matches (no proposal, no verification): copy-heavy outputs (edits, quotes,
extraction) match often, free text rarely.

The lookup adapts to what the sequence offers:
- the match grows past `prompt_lookup_max` (up to LOOKUP_LIMIT tokens) while it keeps matching, to choose the right
  one of several earlier occurrences (a field name that recurs in every record);
- each draft's length follows how much the sequence's own drafts kept before, counted apart by the length of the
  match they came from (a 1-token match is a guess, a 20-token one a copy in progress): the length that gives the
  most tokens per verification's work, none when no length beats a plain decode. So the speculator asks for up to
  K every step (`sizes_drafts`) instead of pacing the sequence by its last verification.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence as Seq

import numpy as np

from ..scheduler import Sequence

LOOKUP_LIMIT = 64  # tokens a match may grow to while choosing among occurrences
# A verification row's work beside a decode step's: ONNX Runtime's float32 GEMM at 8 rows takes 1.48x its time at 1
# (docs/performance.md, "Speculative decoding"), about 0.06 of a step per row.
ROW_COST = 0.06
BUCKETS = 8  # match lengths counted apart: 1 .. 7, and 8 or more
# Per bucket, drafted positions kept over positions tried (one after a rejection is not tried), older counts weighted
# MEMORY times less per draft; PRIOR_KEPT of PRIOR_TRIED before the first. A bucket left unused drifts back to the
# prior by RECOVERY per skipped lookup, so a sequence tries a length again once its text may have changed.
MEMORY, PRIOR_KEPT, PRIOR_TRIED, RECOVERY = 0.8, 3.0, 4.0, 0.9


def match(tokens: np.ndarray, low: int, high: int) -> tuple[int, int]:
    """Where the tokens after the latest earlier occurrence of the longest suffix of `tokens` (>= `low`, <= `high`
    tokens) that occurs before start, and that suffix's length; (-1, 0) when no suffix of `low` tokens recurs."""
    n = tokens.size
    if n <= low:
        return -1, 0
    # Candidate ends: earlier positions holding the last token, latest first; each grows while it keeps matching.
    ends = np.flatnonzero(tokens[:n - 1] == tokens[n - 1])[::-1]
    length = 1
    while ends.size and length < high:
        starts = ends - length
        alive = starts >= 0
        alive[alive] = tokens[starts[alive]] == tokens[n - 1 - length]
        if not alive.any():
            break
        ends, length = ends[alive], length + 1
    if length < low or not ends.size:
        return -1, 0
    return int(ends[0]) + 1, length  # the latest occurrence of the longest match


def lookup(tokens: np.ndarray, low: int, high: int, k: int) -> np.ndarray:
    """Up to `k` tokens after the latest earlier occurrence of the longest suffix of `tokens` (>= `low`, <= `high`
    tokens) that occurs before; empty when no suffix of `low` tokens recurs."""
    after, _ = match(tokens, low, high) if k >= 1 else (-1, 0)
    return tokens[after:min(after + k, tokens.size)] if after >= 0 else tokens[:0]


@dataclass
class _Record:
    """One sequence's acceptance per match-length bucket, and its last draft (to count once it is decided)."""

    kept: np.ndarray = field(default_factory=lambda: np.full(BUCKETS, PRIOR_KEPT))
    tried: np.ndarray = field(default_factory=lambda: np.full(BUCKETS, PRIOR_TRIED))
    start: int = 0  # where the last draft would have gone in the sequence's tokens
    draft: np.ndarray | None = None
    bucket: int = 0

    def learn(self, tokens: np.ndarray) -> None:
        """Count the last draft against the tokens the sequence has now (what the target chose there)."""
        if self.draft is None or tokens.size <= self.start:
            return
        seen = tokens[self.start:self.start + self.draft.size]
        wrong = np.flatnonzero(seen != self.draft[:seen.size])
        kept = int(wrong[0]) if wrong.size else seen.size
        b = self.bucket
        self.kept[b] = self.kept[b] * MEMORY + kept
        self.tried[b] = self.tried[b] * MEMORY + kept + (kept < seen.size)
        self.draft = None

    def length(self, bucket: int, most: int) -> int:
        """The draft length (<= `most`) giving the most tokens per verification's work; 0 if none beats a decode."""
        rate = self.kept[bucket] / self.tried[bucket]
        best, best_gain, tokens, term = 0, 1.0, 1.0, 1.0
        for k in range(1, most + 1):
            term *= rate
            tokens += term
            gain = tokens / (1 + ROW_COST * k)
            if gain > best_gain:
                best, best_gain = k, gain
        if not best:
            self.kept[bucket] = self.kept[bucket] * RECOVERY + PRIOR_KEPT * (1 - RECOVERY)
            self.tried[bucket] = self.tried[bucket] * RECOVERY + PRIOR_TRIED * (1 - RECOVERY)
        return best


class NgramProposer:
    """Keeps each sequence's tokens in an int64 buffer made once (filled as tokens arrive, never rebuilt)."""

    cost = 0.0  # a lookup in the sequence's own tokens: nothing beside the target's step
    sizes_drafts = True  # each draft's length follows its match's record (module docstring)

    def __init__(self, low: int, high: int, max_model_len: int) -> None:
        self.low, self.high, self.max_model_len = low, max(high, LOOKUP_LIMIT), max_model_len
        self._tokens: dict[Sequence, tuple[np.ndarray, list[int]]] = {}  # buffer, [filled]
        self._records: dict[Sequence, _Record] = {}

    def _buffer(self, seq: Sequence) -> np.ndarray:
        held = self._tokens.get(seq)
        if held is None:
            held = self._tokens[seq] = (np.empty(self.max_model_len, np.int64), [0])
        buffer, filled = held
        n = seq.num_verified_tokens
        if filled[0] < n:
            buffer[filled[0]:n] = seq.token_ids[filled[0]:n]
            filled[0] = n
        return buffer[:n]

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = self._buffer(seq)
        record = self._records.get(seq)
        if record is None:
            record = self._records[seq] = _Record()
        record.learn(tokens)
        after, length = match(tokens, self.low, self.high) if k else (-1, 0)
        if after < 0:
            return []
        bucket = min(length, BUCKETS) - 1
        draft = tokens[after:min(after + record.length(bucket, min(k, tokens.size - after)), tokens.size)]
        if draft.size:
            record.start, record.draft, record.bucket = tokens.size, draft, bucket  # a view: verified tokens stay
        return draft.tolist()

    def propose(self, seqs: Seq[Sequence], lengths: Seq[int]) -> list[list[int]]:
        return [self._propose(seq, k) for seq, k in zip(seqs, lengths)]

    def draft_probs(self, seq: Sequence) -> None:
        return None

    def release(self, seq: Sequence) -> None:
        self._tokens.pop(seq, None)
        self._records.pop(seq, None)
