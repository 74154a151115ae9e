"""Which proposed tokens the target keeps: greedy agreement, or rejection sampling (Leviathan et al. 2023, as
vLLM's rejection sampler) so sampled output keeps the target's distribution exactly.

Position j of a verification holds the target's logits after the real tokens and drafts d_0 .. d_{j-1}. With
the target's distribution p_j (temperature, min_p, top_k, top_p applied as the sampler applies them) and the
proposer's q_j, d_j is kept with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection the token comes
from the residual max(0, p_j - q_j), renormalized, and verification stops; when all are kept, one more token is
sampled from the last position's p. Each emitted token is then distributed as p. A proposer that is certain
(n-gram lookup) has q_j = one-hot(d_j): keep with probability p_j(d_j), else sample p_j without d_j.
"""
from __future__ import annotations

import numpy as np

from ..sampling_params import SamplingParams


def target_probs(row: np.ndarray, params: SamplingParams, out: np.ndarray) -> np.ndarray:
    """The distribution `sample_row` draws from, into `out` (float64, the row's size)."""
    np.multiply(row, 1.0 / params.temperature, out=out)
    out -= out.max()
    np.exp(out, out=out)  # unnormalized; the top token's is 1
    if params.min_p > 0:  # against the top token's probability (1 here)
        out[out < params.min_p] = 0.0
    top_k = params.top_k if 0 < params.top_k < row.size else 0
    if top_k and np.count_nonzero(out) > top_k:
        out[np.argpartition(out, -top_k)[:-top_k]] = 0.0
    if params.top_p < 1.0:
        kept = np.flatnonzero(out)
        by_weight = kept[np.argsort(out[kept])[::-1]]
        mass = np.cumsum(out[by_weight])
        keep = int(np.searchsorted(mass, params.top_p * mass[-1]) + 1)
        out[by_weight[keep:]] = 0.0
    out /= out.sum()
    return out


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    mass = np.cumsum(probs)
    return int(np.searchsorted(mass, rng.random() * mass[-1], side="right"))


def accept_greedy(rows: np.ndarray, drafts: list[int]) -> list[int]:
    """The drafts that equal the target's argmax, then the argmax at the first disagreement (or after all)."""
    best = np.argmax(rows, axis=1).tolist()
    out = []
    for draft, target in zip(drafts, best):
        out.append(target)
        if draft != target:
            return out
    out.append(best[len(drafts)])
    return out


def accept_one(row: np.ndarray, draft: int, q: np.ndarray | None, params: SamplingParams,
               rng: np.random.Generator | None, scratch: np.ndarray) -> tuple[int, bool]:
    """One position: the token it emits, and whether that is the draft (verification goes on only then).
    `q` is the proposer's distribution at this position, None for a certain proposal; `rng` None: greedy."""
    if rng is None or params.greedy:
        best = int(np.argmax(row))
        return best, best == draft
    p = target_probs(row, params, scratch)
    q_draft = 1.0 if q is None else float(q[draft])
    if q_draft > 0 and rng.random() * q_draft < p[draft]:
        return draft, True
    if q is None:
        p[draft] = 0.0
    else:
        np.subtract(p, q, out=p)
        np.maximum(p, 0.0, out=p)
    return (_draw(p, rng) if p.any() else draft), False  # an all-zero residual: p == q, the draft stands


def sample_last(row: np.ndarray, params: SamplingParams, rng: np.random.Generator | None,
                scratch: np.ndarray) -> int:
    """The token after the last kept draft, from the target alone."""
    if rng is None or params.greedy:
        return int(np.argmax(row))
    return _draw(target_probs(row, params, scratch), rng)


def accept_sampled(rows: np.ndarray, drafts: list[int], q: np.ndarray | None, params: SamplingParams,
                   rng: np.random.Generator, scratch: np.ndarray) -> list[int]:
    """Rejection sampling over `rows` ([len(drafts) + 1, vocab] logits); `q` [len(drafts), vocab] or None
    (certain proposals); `scratch` float64 [vocab]."""
    out = []
    for j, draft in enumerate(drafts):
        token, kept = accept_one(rows[j], draft, None if q is None else q[j], params, rng, scratch)
        out.append(token)
        if not kept:
            return out
    out.append(sample_last(rows[len(drafts)], params, rng, scratch))
    return out
