"""What a proposer is: tokens that may follow each sequence, verified by the target in the next step."""
from __future__ import annotations

from typing import Protocol, Sequence as Seq

import numpy as np

from ..scheduler import Sequence


class Proposer(Protocol):
    # A proposed token's cost in decode steps of the target (0: free, as n-gram lookup): the speculator proposes
    # only as many tokens as the acceptance it sees pays for (runtime/spec/speculator.py).
    cost: float
    # True: the proposer sizes each draft from what its own drafts kept (n-gram lookup), so the speculator asks for up
    # to K every step instead of pacing the sequence by its last verification.
    sizes_drafts: bool

    def propose(self, seqs: Seq[Sequence], lengths: Seq[int]) -> list[list[int]]:
        """Up to lengths[i] tokens to follow seqs[i]'s tokens (fewer or none when it has nothing to offer)."""

    def draft_probs(self, seq: Sequence) -> np.ndarray | None:
        """The distributions the last proposal for `seq` was sampled from ([k, vocab] float32, a view valid until
        the next proposal); None: each proposed token was certain (q = 1, as n-gram lookup)."""

    def release(self, seq: Sequence) -> None:
        """Forget what is kept for `seq` (it has finished)."""
