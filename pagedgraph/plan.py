"""`pagedgraph plan` and `export --trace`: an export config whose export.buckets are fitted to a traffic trace.

The fitting is the runtime's (runtime/ladder_plan.py: the trace replayed through the engine's scheduler and
packer); this module reads the export and deployment configs it needs and writes the planned export config.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import yaml

from .artifact.settings import validate
from .exporter.buckets import context_ladder
from .exporter.config import ExportConfig
from .runtime.deploy_config import Deployment
from .runtime.ladder_plan import LadderPlan, Ladders, PlanBudget, plan_ladders
from .runtime.step_replay import ServeLimits
from .runtime.traffic import read_trace


def serve_limits(config: ExportConfig, deployment: Deployment | None) -> ServeLimits:
    """What decides each step's shape: the deployment's scheduler and KV settings (its defaults without one)."""
    options = config.export
    if deployment is None:
        return ServeLimits(options.max_model_len, options.block_size)
    scheduler, kv = deployment.scheduler, deployment.kv_cache
    return ServeLimits(min(scheduler.max_model_len or options.max_model_len, options.max_model_len), options.block_size,
                       scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                       scheduler.long_prefill_token_threshold, scheduler.enable_chunked_prefill,
                       scheduler.batch_invariant, kv.enable_prefix_caching, kv.num_blocks)


def export_ladders(config: ExportConfig) -> Ladders:
    buckets = config.export.buckets
    return Ladders(tuple(buckets.decode_batch), tuple(buckets.prefill_tokens), buckets.prefill_max_seqs,
                   tuple(context_ladder(config.export)), tuple(buckets.verify_tokens))


def planned_config(config: ExportConfig, trace: str | Path, deployment: Deployment | None = None,
                   budget: PlanBudget = PlanBudget()) -> tuple[ExportConfig, LadderPlan]:
    """`config` with export.buckets fitted to `trace` (and the plan's record under export.buckets.plan)."""
    limits = serve_limits(config, deployment)
    requests = read_trace(trace, limits.max_model_len)
    plan = plan_ladders(requests, export_ladders(config), limits, config.model.quantization != "none", budget)
    ladders = plan.ladders
    buckets: dict[str, Any] = {"decode_batch": list(ladders.decode_batch), "prefill_tokens": list(ladders.prefill_tokens),
                               "prefill_max_seqs": ladders.prefill_max_seqs,
                               "context_blocks": list(ladders.context_blocks)}
    if ladders.verify_tokens:
        buckets["verify_tokens"] = list(ladders.verify_tokens)
    digest = hashlib.sha256(Path(trace).read_bytes()).hexdigest()
    buckets["plan"] = {"trace": str(trace), "trace_sha256": digest, **plan.record()}
    data = config.model_dump(mode="json", exclude_unset=True)
    data["export"] = {**data.get("export", {}), "buckets": buckets}
    return validate(ExportConfig, data, f"the export config planned from {trace}"), plan


def write_config(config: ExportConfig, path: str | Path, trace: str | Path) -> None:
    data = config.model_dump(mode="json", exclude_unset=True)
    header = (f"# export.buckets fitted to the traffic of {trace} by `pagedgraph plan` (runtime/ladder_plan.py);\n"
              "# export.buckets.plan says what padding to expect of them.\n")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(header + yaml.safe_dump(data, sort_keys=False, width=120, default_flow_style=None))
