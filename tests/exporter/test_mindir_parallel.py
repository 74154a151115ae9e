"""MINDIR gears compiled in parallel worker processes equal those compiled one after another, the progress bar
reports them, and an export with MINDIR that leaves the ladders out gets the short ATC-style ladders."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from tests.mindspore_support import require_mindspore

require_mindspore()

from pagedgraph.artifact.manifest import Manifest  # noqa: E402
from pagedgraph.artifact.mindir import INDEX  # noqa: E402
from pagedgraph.exporter.config import MINDIR_DECODE_BATCHES, MINDIR_PREFILL_TOKENS, ExportConfig  # noqa: E402
from pagedgraph.exporter.export import export  # noqa: E402
from pagedgraph.exporter.mindspore.export import default_workers  # noqa: E402
from pagedgraph.runtime.engine import LLM  # noqa: E402
from pagedgraph.runtime.sampling_params import SamplingParams  # noqa: E402
from tests.random_checkpoint import write_random_llama  # noqa: E402

pytestmark = pytest.mark.slow


def _export(checkpoint: Path, out: Path, workers: int, buckets: dict | None = None) -> str:
    log = io.StringIO()
    export(ExportConfig.model_validate({"model": {"source": str(checkpoint)}, "export": {
        "formats": ["onnx", "mindir"], "max_model_len": 64, "verify_gears": False, "mindir_workers": workers,
        **({"buckets": buckets} if buckets is not None else {})}}), out, log=log)
    return log.getvalue()


def test_parallel_workers_write_the_same_graphs_as_one(tmp_path: Path) -> None:
    checkpoint = write_random_llama(tmp_path / "ckpt")
    buckets = {"decode_batch": [1, 2], "prefill_tokens": [16, 32], "prefill_max_seqs": 2}
    serial = _export(checkpoint, tmp_path / "serial", 1, buckets)
    parallel = _export(checkpoint, tmp_path / "parallel", 2, buckets)
    assert "mindir cpu, 1 worker: 100%" in serial and "mindir cpu, 2 workers: 100%" in parallel
    assert "4/4" in parallel  # 2 prefill + 2 decode gears (context_blocks [4]), counted by the bar
    one, two = (json.loads((tmp_path / name / INDEX).read_text()) for name in ("serial", "parallel"))
    assert one == two
    for family in one["graphs"].values():  # the same graphs (the files differ in MindSpore's unique names)
        for rel in family.values():
            assert _ops(tmp_path / "serial" / rel) == _ops(tmp_path / "parallel" / rel), rel
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    outputs = [[o.token_ids for o in LLM(tmp_path / name, executor="mindspore").generate(
        prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))] for name in ("serial", "parallel")]
    assert outputs[0] == outputs[1] and [len(t) for t in outputs[0]] == [4, 4]


def _ops(path: Path) -> list[str]:
    from mindspore.train.mind_ir_pb2 import ModelProto

    proto = ModelProto()
    proto.ParseFromString(path.read_bytes())
    return [node.op_type for node in proto.graph.node]


def test_mindir_exports_without_buckets_default_to_short_ladders(tmp_path: Path) -> None:
    checkpoint = write_random_llama(tmp_path / "ckpt")
    log = _export(checkpoint, tmp_path / "art", 2)
    gears = Manifest.load(tmp_path / "art").families
    assert sorted({g.seqs for g in gears["decode"].gears}) == list(MINDIR_DECODE_BATCHES)
    assert sorted({g.tokens for g in gears["prefill"].gears}) == list(MINDIR_PREFILL_TOKENS)
    assert sorted({g.blocks for g in gears["decode"].gears}) == [1, 4]  # 64 tokens = 4 blocks, x4 apart
    assert "as ATC recommends" in log and "16/16" in log
    given = _export(checkpoint, tmp_path / "given", 1, {"decode_batch": [2], "prefill_tokens": [16],
                                                         "prefill_max_seqs": 2})
    assert "ATC" not in given and len(Manifest.load(tmp_path / "given").families["decode"].gears) == 1


def test_default_workers_is_bounded_by_cores_and_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker holds weights (their example arguments hold no data), so only the compile's working set counts."""
    import pagedgraph.exporter.mindspore.export as mindir

    monkeypatch.setattr(mindir, "_available_memory", lambda: 64 << 30)
    monkeypatch.setattr(mindir.os, "sched_getaffinity", lambda pid: set(range(16)))
    assert default_workers() == 16
    monkeypatch.setattr(mindir, "_available_memory", lambda: 2 * mindir.COMPILE_BYTES + (1 << 30))
    assert default_workers() == 2
    monkeypatch.setattr(mindir, "_available_memory", lambda: 1 << 20)
    assert default_workers() == 1
