"""How much the speculator proposes: per step (a token budget by default, vLLM's batch limit when set) and per
sequence (following what verification kept)."""
from __future__ import annotations

import numpy as np

from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.sequence import Sequence
from pagedgraph.runtime.spec.config import SpeculativeConfig
from pagedgraph.runtime.spec.speculator import FIRST_PAUSE, Speculator

VOCAB = 16


class Echo:
    """Proposes token 1, as many as asked."""

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


def _speculator(**keys: int) -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=5, **keys)
    return Speculator(config, Echo(), 256, VOCAB, lambda seq: True)


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
