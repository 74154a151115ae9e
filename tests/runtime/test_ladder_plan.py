"""The ladder planner (`pagedgraph plan`, runtime/ladder_plan.py): its padding estimate is what the bench measures on
the trace, it keeps to the gear budget, it is deterministic, bad traces name their line, and a served request log
plans again."""
from __future__ import annotations

import io
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest

from pagedgraph.artifact.manifest import Manifest
from pagedgraph.artifact.settings import load_yaml
from pagedgraph.cli import main
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.plan import planned_config
from pagedgraph.runtime.bench.runner import run_engine, warm_up
from pagedgraph.runtime.bench.suite import BenchOptions, run_bench
from pagedgraph.runtime.bench.workloads import replayed
from pagedgraph.runtime.deploy_config import Deployment, engine_config
from pagedgraph.runtime.engine import LLMEngine
from pagedgraph.runtime.ladder_plan import Ladders, PlanBudget, plan_ladders
from pagedgraph.runtime.step_replay import ServeLimits
from pagedgraph.runtime.traffic import TraceError, TraceRequest, read_trace
from tests.runtime.server.serving import serve

pytestmark = pytest.mark.unit  # tiny models exported by the test

# Small limits and a small KV pool, so the replay chunks prompts and preempts: every path of the scheduler counts.
SCHEDULER = {"max_num_seqs": 6, "max_num_batched_tokens": 96, "long_prefill_token_threshold": 32}
KV_BLOCKS = 24


def _write_trace(path: Path, count: int, seed: int, max_total: int = 250) -> Path:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(count):
        prompt = int(rng.integers(3, 150))
        lines.append(json.dumps({"prompt_tokens": prompt, "completion_tokens": int(rng.integers(2, max_total - prompt))}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _deployment(artifact: Path | str) -> Deployment:
    return Deployment.model_validate({"model": {"artifact": str(artifact)}, "scheduler": SCHEDULER,
                                      "kv_cache": {"num_blocks": KV_BLOCKS}, "executor": {"threads": 2}})


@pytest.fixture(scope="module", params=["none", "w8a16"])
def planned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """A tiny model exported with ladders planned from a trace (w8a16: block-quantized, so batch-invariant steps
    prefer gears of even T and B)."""
    pytest.importorskip("transformers")
    from pagedgraph.exporter.export import export
    from tests.tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp(f"planned-{request.param}")
    config = ExportConfig.model_validate({"model": {"source": str(make_tiny_hf_checkpoint(root / "hf")),
                                                    "quantization": request.param},
                                          "export": {"max_model_len": 256, "verify_gears": False, "buckets": {
                                              "decode_batch": [1, 8], "prefill_tokens": [32, 128],
                                              "prefill_max_seqs": 8}}})
    trace = _write_trace(root / "trace.jsonl", 20, seed=1)
    config, plan = planned_config(config, trace, _deployment("unused"), PlanBudget(max_gears_per_family=24))
    export(config, root / "artifact", log=io.StringIO())
    return root / "artifact", trace, plan


def test_estimate_equals_the_bench_measurement(planned: tuple) -> None:
    artifact, trace, plan = planned
    deployment = _deployment(artifact)
    engine = LLMEngine(artifact, engine_config(deployment, Manifest.load(artifact), "test"))
    warm_up(engine)
    record = run_engine(engine, replayed(engine.model.vocab_size, read_trace(trace), seed=3))
    figures = record.figures()
    assert figures["preemptions"] > 0 and plan.steps == figures["steps"]
    assert figures["padding_waste"] == plan.padding.waste
    assert record.bucket_hits == plan.padding.hits
    assert plan.padding.waste <= plan.before.waste


def test_bench_compares_ladders_in_one_invocation(planned: tuple) -> None:
    """`bench --workload trace --compare-buckets`: the planned ladders against a coarser subset, same artifact."""
    artifact, trace, plan = planned
    coarse = {"decode_batch": [plan.ladders.decode_batch[0], plan.ladders.decode_batch[-1]]}
    results = run_bench(BenchOptions(str(artifact), workload="trace", trace=str(trace), baseline=None, micro=False,
                                     threads=2, compare_buckets=coarse), log=io.StringIO())
    compared = results["compare_buckets"]
    assert len(compared["ratio_per_round"]) == 2 and compared["buckets"] == coarse
    assert compared["padding_waste_compared"] > compared["padding_waste_all"] == results["padding_waste"]


def test_served_request_log_plans_again(planned: tuple, tmp_path: Path) -> None:
    """server.request_log records each finished request as a trace line that `pagedgraph plan` reads; /metrics shows
    the live padding waste beside the plan's."""
    artifact, _, plan = planned
    log = tmp_path / "requests.jsonl"
    asked = [(5, 7), (40, 3), (12, 20)]
    with serve(artifact, server={"request_log": str(log)}) as server:
        usage = []
        for prompt, tokens in asked:
            answer = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "model": "smol", "prompt": list(range(10, 10 + prompt)), "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}).json()
            usage.append((answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]))
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert usage == asked
    assert [(r.prompt_tokens, r.completion_tokens) for r in read_trace(log)] == asked
    gauges = dict(re.findall(r"^pagedgraph_(planned_padding_waste|padding_waste) (\S+)$", metrics, re.M))
    assert float(gauges["planned_padding_waste"]) == round(plan.padding.waste, 6)
    assert float(gauges["padding_waste"]) >= 0
    config = tmp_path / "export.yaml"
    config.write_text(json.dumps(Manifest.load(artifact).export_config))
    out = tmp_path / "planned.yaml"
    assert main(["plan", "--trace", str(log), "--config", str(config), "--out", str(out)]) == 0
    again = load_yaml(ExportConfig, out)
    assert again.export.buckets.plan is not None and again.export.buckets.plan.requests == len(asked)
    assert again.model == ExportConfig.model_validate(Manifest.load(artifact).export_config).model


LADDERS = Ladders((1, 4, 16, 32), (64, 256, 512, 1024, 2048), 32, (4, 8, 16, 32, 64, 128))


def _requests(count: int, seed: int) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    prompts = np.exp(rng.uniform(np.log(8), np.log(1200), count)).astype(int)
    return [TraceRequest(int(p), int(rng.integers(1, 2048 - p))) for p in prompts]


@pytest.mark.parametrize("cap, context_gears", [(100, None), (24, 3), (12, 1)])
def test_gear_cap_is_kept(cap: int, context_gears: int | None) -> None:
    plan = plan_ladders(_requests(300, seed=2), LADDERS, ServeLimits(2048, 16), block_quantized=True,
                        budget=PlanBudget(max_gears_per_family=cap, context_gears=context_gears))
    counts = plan.ladders.gear_counts()
    assert max(counts.values()) <= cap and counts == {name: len(g) for name, g in plan.ladders.gears().items()}
    ladders = plan.ladders
    assert ladders.decode_batch[-1] == 32 and ladders.prefill_tokens[-1] == 2048 and ladders.context_blocks[-1] == 128
    assert plan.padding.waste <= plan.before.waste


def test_total_budget_is_kept_and_bad_budgets_say_so() -> None:
    plan = plan_ladders(_requests(100, seed=4), LADDERS, ServeLimits(2048, 16), budget=PlanBudget(max_gears=80))
    assert sum(plan.ladders.gear_counts().values()) <= 80
    with pytest.raises(ValueError, match="max_gears = 20 .*raise the budget"):
        plan_ladders(_requests(10, seed=4), LADDERS, ServeLimits(2048, 16), budget=PlanBudget(max_gears=20))
    with pytest.raises(ValueError, match="max_gears_per_family = 101: must be 1 to 100"):
        plan_ladders(_requests(10, seed=4), LADDERS, ServeLimits(2048, 16), budget=PlanBudget(max_gears_per_family=101))


def test_plan_is_deterministic(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", 200, seed=5, max_total=2048)
    config = tmp_path / "export.yaml"
    config.write_text("export:\n  max_model_len: 2048\n  buckets:\n    decode_batch: [1, 8, 32]\n")
    outputs = []
    for run in range(2):
        out = tmp_path / f"planned{run}.yaml"
        assert main(["plan", "--trace", str(trace), "--config", str(config), "--out", str(out)]) == 0
        outputs.append(out.read_text())
    assert outputs[0] == outputs[1]
    plan = load_yaml(ExportConfig, tmp_path / "planned0.yaml").export.buckets.plan
    assert plan is not None and plan.expected_padding_waste < plan.padding_waste_before


@pytest.mark.parametrize("line, says", [
    ('{"prompt_tokens": 10}', "trace.jsonl:2: field 'completion_tokens' is missing"),
    ('{"prompt_tokens": "10", "completion_tokens": 3}', "trace.jsonl:2: prompt_tokens = '10': must be an integer >= 1"),
    ('{"prompt_tokens": 10, "completion_tokens": 0}', "trace.jsonl:2: completion_tokens = 0: must be an integer >= 1"),
    ('{"prompt_tokens": 10, "completion_tokens": true}', "trace.jsonl:2: completion_tokens = True"),
    ('[10, 3]', "trace.jsonl:2: each line must be a JSON object"),
    ('{"prompt_tokens": 10,', "trace.jsonl:2: not valid JSON"),
    ('{"prompt_tokens": 2000, "completion_tokens": 100}', "trace.jsonl:2: prompt_tokens \\+ completion_tokens = 2100 "
                                                          "exceeds max_model_len 2048"),
])
def test_bad_trace_names_line_and_field(tmp_path: Path, line: str, says: str) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"prompt_tokens": 5, "completion_tokens": 3}\n' + line + "\n")
    with pytest.raises(TraceError, match=says):
        read_trace(trace, 2048)
    assert main(["plan", "--trace", str(trace), "--out", str(tmp_path / "out.yaml")]) == 2
