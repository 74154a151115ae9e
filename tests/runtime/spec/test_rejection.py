"""Rejection sampling keeps the target distribution at the first speculated position (a chi-square over draws),
and the same test fails when the rejection step is skipped."""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.spec.rejection import accept_greedy, accept_sampled, target_probs

pytestmark = pytest.mark.unit
DRAWS = 4000
# The chi-square statistic a true distribution exceeds with probability 1e-3, by degrees of freedom.
CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}
LOGITS = np.array([2.0, 1.5, 0.5, 0.0, -0.5, -3.0], np.float32)  # the target at the first speculated position
Q = np.array([0.05, 0.1, 0.5, 0.2, 0.1, 0.05])  # the draft's, far from the target's


def _first_tokens(params: SamplingParams, q: np.ndarray | None, skip_rejection: bool = False) -> np.ndarray:
    rng = np.random.default_rng(7)
    rows = np.stack([LOGITS, LOGITS[::-1]])  # position 0, then the bonus position
    scratch = np.empty(LOGITS.size, np.float64)
    counts = np.zeros(LOGITS.size)
    for _ in range(DRAWS):
        draft = int(rng.choice(LOGITS.size, p=Q)) if q is not None else 3  # n-gram: one certain token
        first = draft if skip_rejection else accept_sampled(rows, [draft], q, params, rng, scratch)[0]
        counts[first] += 1
    return counts


def _fits(counts: np.ndarray, params: SamplingParams) -> bool:
    """Whether `counts` pass a chi-square test (level 1e-3) against the target's distribution."""
    expected = target_probs(LOGITS, params, np.empty(LOGITS.size)) * DRAWS
    keep = expected > 0
    if counts[~keep].sum():  # a token outside the target's support
        return False
    statistic = float((((counts[keep] - expected[keep]) ** 2) / expected[keep]).sum())
    return statistic < CRITICAL[int(keep.sum()) - 1]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.2, top_p=0.8)], ids=["t1", "top_k", "top_p"])
def test_draft_model_rejection_keeps_the_target_distribution(params: SamplingParams) -> None:
    q = np.stack([Q, Q])
    assert _fits(_first_tokens(params, q), params)
    assert not _fits(_first_tokens(params, q, skip_rejection=True), params)


def test_certain_proposals_keep_the_target_distribution() -> None:
    """n-gram lookup: q is one-hot at the proposed token; rejected, the token comes from p without it."""
    params = SamplingParams(temperature=1.0)
    assert _fits(_first_tokens(params, None), params)
    assert not _fits(_first_tokens(params, None, skip_rejection=True), params)


def test_target_probs_follow_the_sampler_truncations() -> None:
    out = np.empty(LOGITS.size)
    assert np.count_nonzero(target_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2), out)) == 2
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, top_p=0.5), out).copy()
    assert np.count_nonzero(p) == 2 and p[0] > p[1]  # softmax mass of the top two: 0.47, 0.29 (nucleus 0.5)
    p = target_probs(LOGITS, SamplingParams(temperature=1.0, min_p=0.5), out)
    assert np.flatnonzero(p).tolist() == [0, 1]  # exp(-0.5) = 0.61 of the top token's probability is kept
    np.testing.assert_allclose(target_probs(LOGITS, SamplingParams(temperature=1.0), out).sum(), 1.0)


def test_greedy_keeps_the_agreeing_prefix_and_the_targets_next_token() -> None:
    rows = np.eye(5, dtype=np.float32)[[1, 2, 4, 3]]  # argmax per position: 1, 2, 4, 3
    assert accept_greedy(rows, [1, 2, 3]) == [1, 2, 4]
    assert accept_greedy(rows, [1, 2, 4]) == [1, 2, 4, 3]
    assert accept_greedy(rows, [0, 2, 4]) == [1]
