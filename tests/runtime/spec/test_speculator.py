"""How much the speculator proposes: per step (a token budget by default, vLLM's batch limit when set) and per
sequence (following what verification kept)."""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.scheduler import Sequence
from pagedgraph.runtime.spec.config import SpeculativeConfig
from pagedgraph.runtime.spec.speculator import FIRST_PAUSE, LAST_PROBE, Speculator

pytestmark = pytest.mark.unit
VOCAB = 16


class Echo:
    """Proposes token 1, as many as asked, at `cost` target decode steps a token."""

    def __init__(self, cost: float = 0.0, sizes_drafts: bool = False) -> None:
        self.cost = cost
        self.sizes_drafts = sizes_drafts

    def propose(self, seqs: list[Sequence], lengths: list[int]) -> list[list[int]]:
        return [[1] * k for k in lengths]

    def draft_probs(self, seq: Sequence) -> None:
        return None

    def release(self, seq: Sequence) -> None:
        pass


def _decoding(count: int) -> list[Sequence]:
    seqs = [Sequence(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=100, temperature=0), float(i)) for i in range(count)]
    for seq in seqs:
        seq.num_computed_tokens = 2  # one token left: the next step decodes it
    return seqs


def _speculator(cost: float = 0.0, **keys: int) -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, **keys)
    return Speculator(config, Echo(cost), 256, VOCAB, lambda seq: True)


def _proposed(speculator: Speculator, seqs: list[Sequence]) -> list[int]:
    speculator.propose(seqs)
    counts = [s.num_draft_tokens for s in seqs]
    for seq in seqs:
        seq.drop_drafts()
    return counts


def test_by_default_a_speculating_step_holds_at_most_eight_tokens() -> None:
    speculator = _speculator()
    assert _proposed(speculator, _decoding(1)) == [5]
    assert _proposed(speculator, _decoding(3)) == [5, 0, 0]  # 3 + 5 = 8 tokens: the first arrival's
    assert _proposed(speculator, _decoding(6)) == [2, 0, 0, 0, 0, 0]
    assert _proposed(speculator, _decoding(8)) == [0] * 8


def test_a_proposer_that_sizes_its_drafts_is_asked_for_k_after_misses() -> None:
    """No pacing, no pause: the proposer (n-gram lookup) decides how many of the K it drafts."""
    speculator = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=5), Echo(sizes_drafts=True), 4096,
                            VOCAB, lambda seq: True)
    (seq,) = _decoding(1)
    wrong = np.zeros((6, VOCAB), np.float32)
    for _ in range(4):
        assert _proposed(speculator, [seq]) == [5]
        speculator.propose([seq])
        assert speculator.verify(seq, wrong) == [0]
    assert speculator.stats.num_accepted_tokens == 0 and speculator.stats.num_drafts == 4


def test_disable_by_batch_size_is_vllms_rule() -> None:
    speculator = _speculator(disable_by_batch_size=2)
    assert _proposed(speculator, _decoding(2)) == [5, 5]
    assert _proposed(speculator, _decoding(3)) == [0, 0, 0]


def test_a_sequence_whose_drafts_miss_proposes_less_then_pauses() -> None:
    speculator = _speculator()
    (seq,) = _decoding(1)
    wrong = np.zeros((6, VOCAB), np.float32)  # the target's argmax is 0 everywhere: every draft (1) is rejected
    kept_two = np.zeros((6, VOCAB), np.float32)
    kept_two[:2, 1] = 1.0
    speculator.propose([seq])
    assert speculator.verify(seq, kept_two) == [1, 1, 0]
    assert _proposed(speculator, [seq]) == [3]  # two kept: two plus one next time
    for _ in range(2):
        speculator.propose([seq])
        assert speculator.verify(seq, wrong[:seq.num_draft_tokens + 1]) == [0]
    assert [_proposed(speculator, [seq])[0] for _ in range(FIRST_PAUSE + 1)] == [0] * FIRST_PAUSE + [1]
    stats = speculator.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 5 + 3 + 1, 2)


def _verify_all(speculator: Speculator, seq: Sequence, kept: int, steps: int) -> list[int]:
    """`steps` engine steps in which the target keeps the first `kept` drafts; the drafts proposed at each."""
    proposed = []
    for _ in range(steps):
        speculator.propose([seq])
        n = seq.num_draft_tokens
        proposed.append(n)
        if n:
            rows = np.zeros((n + 1, VOCAB), np.float32)
            rows[:kept, 1] = 1.0  # argmax 1 (the draft) at the first `kept` positions, then 0
            speculator.verify(seq, rows)
    return proposed


def test_a_costly_draft_that_the_target_rejects_pauses_and_probes() -> None:
    """At 0.3 decode steps a draft token, a sequence whose drafts are all rejected stops proposing after a few
    verifications (its acceptance falls below what pays), tries one draft after ever longer pauses, and none once
    the pauses pass LAST_PROBE steps."""
    proposed = _verify_all(_speculator(cost=0.3), _decoding(1)[0], kept=0, steps=400)
    assert sum(n > 0 for n in proposed) <= 10 and sum(proposed) <= 12, proposed
    assert max(proposed[20:]) == 1  # probes of one draft
    assert not any(proposed[2 * LAST_PROBE + 20:])


def test_a_costly_draft_that_the_target_keeps_goes_on_at_the_length_that_pays() -> None:
    """All drafts kept: the acceptance rises from its prior (0.75: 2 drafts pay best at 0.3 steps a token) and the
    length with it, up to K = 5; at a cost of 1 (a draft as dear as the target) no length beats a plain decode."""
    assert _verify_all(_speculator(cost=0.3), _decoding(1)[0], kept=5, steps=8) == [2, 3, 4, 5, 5, 5, 5, 5]
    free = _verify_all(_speculator(cost=0.0), _decoding(1)[0], kept=0, steps=3)
    assert free[0] == 5  # n-gram lookup: what the rejections leave (the pace above), never the cost rule
    assert _verify_all(_speculator(cost=1.0), _decoding(1)[0], kept=5, steps=3) == [0, 0, 0]
