"""Prompt log-probabilities (vLLM's `prompt_logprobs`): how likely each prompt token was, given its prefix.

The bucket graph returns logits only for the rows named in `logits_indices`, one per sequence slot
of the gear. A sequence that asks for prompt logprobs therefore gets one logits row per token it
feeds: the scheduler caps its chunks to the rows the gear can return, the packer points the spare
`logits_indices` entries at the chunk's rows (after the one row per sequence the sampler reads), and
the engine turns those rows into the entries below.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability and its rank in the vocabulary (1: the most likely), as vLLM reports it."""

    logprob: float
    rank: int


# Per prompt position: None for the first token, else the prompt token plus the top-k alternatives.
PromptLogprobs = list[Optional[dict[int, Logprob]]]


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, so that summed log-likelihoods over thousands of tokens stay exact."""
    rows = rows.astype(np.float64)
    rows -= rows.max(axis=1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(axis=1, keepdims=True))
    return rows


def prompt_logprob_entries(logits: np.ndarray, targets: Sequence[int], k: int) -> list[dict[int, Logprob]]:
    """For row i of `logits` (the position before `targets[i]`): `targets[i]` and the k most likely tokens."""
    logp = log_softmax(logits)
    picked = logp[np.arange(len(targets)), np.asarray(targets, dtype=np.int64)]
    ranks = (logp > picked[:, None]).sum(axis=1) + 1
    entries = []
    if k:
        best = np.argpartition(logp, -k, axis=1)[:, -k:]
        best = np.take_along_axis(best, np.argsort(-np.take_along_axis(logp, best, axis=1), axis=1), axis=1)
    for i, token in enumerate(targets):
        entry = {int(token): Logprob(float(picked[i]), int(ranks[i]))}
        if k:
            for r, alt in enumerate(best[i].tolist(), 1):
                entry.setdefault(alt, Logprob(float(logp[i, alt]), r))
        entries.append(entry)
    return entries
