"""N-gram prompt lookup: the longest recurring suffix (prompt_lookup_max down to prompt_lookup_min), its latest
earlier occurrence, and the tokens that followed it."""
from __future__ import annotations

import numpy as np
import pytest

from pagedgraph.runtime.sampling_params import SamplingParams
from pagedgraph.runtime.scheduler import Sequence
from pagedgraph.runtime.spec.ngram import NgramProposer, lookup

pytestmark = pytest.mark.unit


def test_the_longest_suffix_wins_over_a_later_shorter_match() -> None:
    tokens = np.array([1, 2, 3, 10, 11, 9, 3, 20, 21, 1, 2, 3])
    assert lookup(tokens, 1, 3, 2).tolist() == [10, 11]  # [1 2 3] recurs at 0; [3] alone would give 20 21
    assert lookup(tokens, 1, 1, 2).tolist() == [20, 21]  # only one-token suffixes: the latest 3
    assert lookup(tokens, 4, 5, 2).tolist() == []  # no suffix of 4 recurs


def test_proposals_stop_at_the_end_and_need_a_match() -> None:
    assert lookup(np.array([5, 6, 7, 5]), 1, 2, 4).tolist() == [6, 7, 5]
    assert lookup(np.array([1, 2, 3]), 1, 2, 4).tolist() == []
    assert lookup(np.array([4, 4]), 1, 2, 0).tolist() == []


def test_the_proposer_reads_only_verified_tokens() -> None:
    seq = Sequence("r", [1, 2, 3, 4, 1, 2], SamplingParams(temperature=0), 0.0)
    proposer = NgramProposer(1, 3, 64)
    assert proposer.propose([seq], [2]) == [[3, 4]]
    seq.set_drafts([3, 4])  # drafts in flight are not part of the sequence's own tokens
    assert proposer.propose([seq], [3]) == [[3, 4, 1]]
    seq.drop_drafts()
    seq.token_ids.append(3)
    assert proposer.propose([seq], [2]) == [[4, 1]]


def test_the_match_grows_past_prompt_lookup_max_to_choose_the_occurrence() -> None:
    """Two records share their last 3 tokens; the longer match picks the record being copied, not the latest."""
    tokens = np.array([7, 1, 2, 3, 40, 8, 1, 2, 3, 50, 7, 1, 2, 3])
    assert lookup(tokens, 1, 3, 1).tolist() == [50]  # up to 3 tokens: the latest occurrence
    seq = Sequence("r", tokens.tolist(), SamplingParams(temperature=0), 0.0)
    assert NgramProposer(1, 3, 64).propose([seq], [1]) == [[40]]  # [7 1 2 3] recurs at 0 only


def test_draft_length_follows_what_drafts_of_that_match_length_kept() -> None:
    """A sequence whose 1-token matches never hold stops drafting from them; its long matches still draft K."""
    seq = Sequence("r", [5, 9, 1, 2, 3, 4, 6, 7, 8, 1, 2, 3, 4, 6, 7], SamplingParams(temperature=0), 0.0)
    proposer = NgramProposer(1, 5, 256)
    assert proposer.propose([seq], [4]) == [[8, 1, 2, 3]]  # a long match: the prior lets it draft all 4
    lengths = []
    for new in range(100, 140, 2):  # a new token, then 5: only "5" recurs, and the target never goes on as before
        seq.token_ids += [new, 5]
        lengths.append(len(proposer.propose([seq], [4])[0]))
        seq.token_ids.append(new + 1)
    assert lengths[0] == 4 and lengths[-1] == 0
    seq.token_ids += [1, 2, 3, 4, 6]
    assert proposer.propose([seq], [4]) == [[7, 100, 5, 101]]  # the latest occurrence of 1 2 3 4 6, all 4
