"""N-gram prompt lookup (vLLM's `ngram`): the tokens that followed the latest earlier occurrence of the
sequence's longest matching suffix, `prompt_lookup_max` down to `prompt_lookup_min` tokens long.

Costs nothing when nothing matches (no proposal, no verification): copy-heavy outputs (edits, quotes,
extraction) match often, free text rarely.
"""
from __future__ import annotations

from typing import Sequence as Seq

import numpy as np

from ..scheduler import Sequence


def lookup(tokens: np.ndarray, low: int, high: int, k: int) -> np.ndarray:
    """Up to `k` tokens after the latest earlier occurrence of the longest suffix of `tokens` (>= `low`, <= `high`
    tokens) that occurs before; empty when no suffix of `low` tokens recurs."""
    n = tokens.size
    if n <= low or k < 1:
        return tokens[:0]
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
        return tokens[:0]
    after = ends[0] + 1  # the latest occurrence of the longest match
    return tokens[after:min(after + k, n)]


class NgramProposer:
    """Keeps each sequence's tokens in an int64 buffer made once (filled as tokens arrive, never rebuilt)."""

    cost = 0.0  # a lookup in the sequence's own tokens: nothing beside the target's step

    def __init__(self, low: int, high: int, max_model_len: int) -> None:
        self.low, self.high, self.max_model_len = low, high, max_model_len
        self._tokens: dict[Sequence, tuple[np.ndarray, list[int]]] = {}  # buffer, [filled]

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

    def propose(self, seqs: Seq[Sequence], lengths: Seq[int]) -> list[list[int]]:
        return [lookup(self._buffer(seq), self.low, self.high, k).tolist() if k else []
                for seq, k in zip(seqs, lengths)]

    def draft_probs(self, seq: Sequence) -> None:
        return None

    def release(self, seq: Sequence) -> None:
        self._tokens.pop(seq, None)
