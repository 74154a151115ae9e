"""ONNX Runtime's session settings: the workers spin within a step unless OMP_WAIT_POLICY=PASSIVE says the cores are
shared (docs/server.md)."""
from __future__ import annotations

import pytest

from pagedgraph.runtime.executor_ort import session_options

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("policy,spinning", [(None, "1"), ("ACTIVE", "1"), ("PASSIVE", "0"), (" passive ", "0")])
def test_omp_wait_policy_passive_stops_the_workers_spinning(monkeypatch: pytest.MonkeyPatch, policy: str | None,
                                                             spinning: str) -> None:
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    options = session_options(2)
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == spinning
    assert options.get_session_config_entry("session.force_spinning_stop") == "1"
    assert options.intra_op_num_threads == 2
