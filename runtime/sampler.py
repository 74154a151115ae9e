"""Token selection from the LM-head rows: greedy, temperature, top-k, top-p, per-request seeds."""
from __future__ import annotations

import numpy as np

from runtime.sequence import Sequence


def _log_softmax(row: np.ndarray) -> np.ndarray:
    shifted = row - row.max()
    return shifted - np.log(np.exp(shifted).sum())


def sample_row(row: np.ndarray, seq: Sequence) -> int:
    params = seq.params
    if params.greedy:
        return int(np.argmax(row))
    scaled = row.astype(np.float64) / params.temperature
    if 0 < params.top_k < scaled.size:
        candidates = np.argpartition(scaled, -params.top_k)[-params.top_k:]
    else:
        candidates = np.arange(scaled.size)
    order = candidates[np.argsort(scaled[candidates])[::-1]]
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    if params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    assert seq.rng is not None
    return int(order[seq.rng.choice(order.size, p=probs)])


def sample(logits: np.ndarray, seqs: list[Sequence]) -> list[int]:
    """One token per row; greedy rows are decided in one vectorized argmax."""
    if all(s.params.greedy for s in seqs):
        return np.argmax(logits, axis=1).tolist()
    return [sample_row(logits[i], s) for i, s in enumerate(seqs)]


def top_logprobs(row: np.ndarray, token: int, k: int) -> dict[int, float]:
    """The sampled token's log-probability plus the k most likely alternatives (model distribution)."""
    logp = _log_softmax(row.astype(np.float64))
    best = np.argpartition(logp, -k)[-k:] if k else np.empty(0, np.int64)
    return {int(t): float(logp[t]) for t in (token, *best.tolist())}
