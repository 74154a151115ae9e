"""/metrics carries vLLM's spec_decode counters when speculation is on, and nothing of them when it is off."""
from __future__ import annotations

import pytest

from pagedgraph.runtime.engine import EngineSnapshot
from pagedgraph.runtime.server.metrics import Metrics, Scrape, ServerCounters
from pagedgraph.runtime.spec.speculator import SpecDecodeStats

pytestmark = pytest.mark.unit


def _render(spec: dict | None) -> str:
    snap = EngineSnapshot(1, 0, 10, 9, 0, 5, 0.1, 0.01, 8, 8, 8, 0, 0, 0, spec_decode=spec)
    return Metrics("m", 256).render(Scrape(snap, ServerCounters(), 1, 1)).decode()


def test_spec_decode_counters_have_vllms_names() -> None:
    stats = SpecDecodeStats(num_drafts=3, num_draft_tokens=9, num_accepted_tokens=5, accepted_per_pos=[3, 2, 0])
    text = _render(stats.to_dict())
    assert 'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 9.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 5.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 2.0' in text
    assert stats.acceptance_rate == 5 / 9 and stats.mean_acceptance_length == 1 + 5 / 3
    assert "spec_decode" not in _render(None)
