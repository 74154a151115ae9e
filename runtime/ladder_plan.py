"""Bucket ladders fitted to a traffic trace: the least padded work under a gear budget (`pagedgraph plan`).

The trace is replayed through the engine's own scheduler (runtime/step_replay.py) with the limits the export
and deployment already serve with, so the plan changes no step, only the gear each step pads to. Then each
ladder is the optimal one of its size for the steps' distribution (dynamic programming over the distinct
sizes: the k rungs that minimise the padded rows, the top rung fixed by the limits), and the sizes are split
between the families within the budget: at most `max_gears_per_family` gears per family (ATC's 100), at most
`max_gears` in all (each gear is one static graph MINDIR and ATC compile, and a first step ONNX Runtime warms).
A family's gears are its rungs times the context-block (M) ladder's, which is fitted the same way with the
number of rungs the export had. The padding reported is the packer's own choice over the replayed steps.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

import numpy as np

from ..graphs.contract import DECODE, MAX_GEARS_PER_FAMILY, PREFILL, Gear, ladder_gears
from .model_runner import GearSelector, StepShape
from .step_replay import Padding, ServeLimits, padding, replay
from .traffic import TraceRequest

MAX_DISTINCT_SIZES = 1024  # beyond this, sizes are rounded up to a grid so the search stays within a second


@dataclass(frozen=True)
class Ladders:
    """The export.buckets ladders (verify_tokens are kept as they are: speculative decoding's, not the trace's)."""

    decode_batch: tuple[int, ...]
    prefill_tokens: tuple[int, ...]
    prefill_max_seqs: int
    context_blocks: tuple[int, ...]
    verify_tokens: tuple[int, ...] = ()

    def gears(self) -> dict[str, tuple[Gear, ...]]:
        return ladder_gears(self.decode_batch, self.prefill_tokens + self.verify_tokens, self.prefill_max_seqs,
                            self.context_blocks)

    def gear_counts(self) -> dict[str, int]:
        return {family: len(gears) for family, gears in self.gears().items()}


@dataclass(frozen=True)
class PlanBudget:
    max_gears_per_family: int = MAX_GEARS_PER_FAMILY
    max_gears: int | None = None  # all families together; default: max_gears_per_family each
    context_gears: int | None = None  # rungs of the M ladder; default: as many as the export's
    # Consecutive rungs at most this far apart, from the export's smallest rung up: a step of a size the trace never
    # showed pads at most this much (the default ladders' powers of two are 2 apart).
    max_rung_ratio: float = 2.0


@dataclass(frozen=True)
class LadderPlan:
    ladders: Ladders
    padding: Padding  # the plan's, on the replayed trace
    before: Padding  # the export's own ladders, on the same steps
    before_ladders: Ladders
    limits: ServeLimits  # the effective ones: clamped to the export's largest gears
    budget: PlanBudget
    requests: int
    prompt_tokens: int
    completion_tokens: int

    @property
    def steps(self) -> int:
        return sum(self.padding.steps.values())

    def record(self) -> dict[str, Any]:
        """What export.buckets.plan keeps (manifest, `pagedgraph inspect`, /metrics)."""
        limits, budget = self.limits, self.budget
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "steps": self.steps,
                "expected_padding_waste": round(self.padding.waste, 6),
                "padding_waste_before": round(self.before.waste, 6),
                "context_padding": round(self.padding.context_waste, 6),
                "gears": self.ladders.gear_counts(),
                "limits": {"max_num_seqs": limits.max_num_seqs, "max_num_batched_tokens": limits.max_num_batched_tokens,
                           "max_model_len": limits.max_model_len,
                           "long_prefill_token_threshold": limits.long_prefill_token_threshold,
                           "enable_chunked_prefill": limits.enable_chunked_prefill,
                           "batch_invariant": limits.batch_invariant, "num_blocks": limits.num_blocks},
                "budget": {"max_gears_per_family": budget.max_gears_per_family, "max_gears": budget.max_gears,
                           "context_gears": len(self.ladders.context_blocks), "max_rung_ratio": budget.max_rung_ratio}}

    def table(self) -> str:
        """The plan, explained: per family its ladder, gears, steps, tokens and padding, against the export's."""
        new, old = self.padding, self.before
        counts, old_counts = self.ladders.gear_counts(), self.before_ladders.gear_counts()
        rungs = {DECODE: ("B", self.ladders.decode_batch, self.before_ladders.decode_batch),
                 PREFILL: ("T", self.ladders.prefill_tokens + self.ladders.verify_tokens,
                           self.before_ladders.prefill_tokens + self.before_ladders.verify_tokens)}
        m = len(self.ladders.context_blocks)
        lines = [f"{self.requests} requests ({self.prompt_tokens:,} prompt + {self.completion_tokens:,} completion "
                 f"tokens) replayed in {self.steps:,} steps at max_num_seqs {self.limits.max_num_seqs}, "
                 f"max_num_batched_tokens {self.limits.max_num_batched_tokens}",
                 "",
                 "| family | planned ladder | gears | steps | real tokens | computed | padding waste | export's ladder "
                 "| its gears | its waste |",
                 "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
        for family in (DECODE, PREFILL):
            dim, planned, before = rungs[family]
            lines.append(f"| {family} | {dim} {compact(planned)} | {len(set(planned))} x {m} = {counts[family]} | "
                         f"{new.steps.get(family, 0):,} | {new.real.get(family, 0):,} | "
                         f"{new.computed.get(family, 0):,} | {new.family_waste(family):.3f} | {dim} {compact(before)} "
                         f"| {old_counts[family]} | {old.family_waste(family):.3f} |")
        lines.append(f"| context | M {compact(self.ladders.context_blocks)} | x {m} | | {new.real_blocks:,} blocks | "
                     f"{new.computed_blocks:,} | {new.context_waste:.3f} | M {compact(self.before_ladders.context_blocks)} "
                     f"| x {len(self.before_ladders.context_blocks)} | {old.context_waste:.3f} |")
        lines.append(f"| all | | {sum(counts.values())} | {self.steps:,} | {sum(new.real.values()):,} | "
                     f"{sum(new.computed.values()):,} | **{new.waste:.3f}** | | {sum(old_counts.values())} | "
                     f"{old.waste:.3f} |")
        return "\n".join(lines)


def compact(values: Iterable[int]) -> str:
    """1 2 3 4 8 -> '1-4 8'."""
    values = sorted(set(values))
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return " ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else " ".join(map(str, r)) for r in runs)


def plan_ladders(requests: Sequence[TraceRequest], export: Ladders, limits: ServeLimits, block_quantized: bool = False,
                 budget: PlanBudget = PlanBudget()) -> LadderPlan:
    """The ladders that serve `requests` with the least padded tokens within `budget` (see the module docstring)."""
    if not 1 <= budget.max_gears_per_family <= MAX_GEARS_PER_FAMILY:
        raise ValueError(f"max_gears_per_family = {budget.max_gears_per_family}: must be 1 to {MAX_GEARS_PER_FAMILY} "
                         "(ATC's --dynamic_dims takes at most 100 gears)")
    if budget.max_rung_ratio <= 1:
        raise ValueError(f"max_rung_ratio = {budget.max_rung_ratio}: must be > 1 (2: each rung at most twice the "
                         "one before)")
    old_gears = export.gears()
    max_seqs, max_tokens, _ = GearSelector(old_gears).fit_limits(limits.max_num_seqs, limits.max_num_batched_tokens)
    effective = replace(limits, max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens)
    even = limits.batch_invariant and block_quantized
    steps = replay(requests, old_gears, effective, block_quantized)
    grid, ratio = (2 if even else 1), budget.max_rung_ratio
    # The M ladder keeps its number of rungs (M padding costs only where attention reads the gear's M: ONNX
    # Runtime without the custom kernels); with too few for `ratio`, they are spread as evenly as they can be.
    low, high = min(export.context_blocks), max(export.context_blocks)
    wanted = min(budget.context_gears or len(export.context_blocks), high - low + 1)
    context_ratio = max(ratio, (high / low) ** (1 / (wanted - 1)) if wanted > 1 else high / low)
    while not (context := _best_rungs(Counter(s.blocks for s in steps), low if wanted > 1 else high, high, wanted,
                                      1, context_ratio)):
        context_ratio *= 1.05  # integer rungs lose a little of each step
    m = len(context[-1][1])
    verify = export.verify_tokens
    per_family = budget.max_gears_per_family // m
    decode = _best_rungs(Counter(s.tokens for s in steps if s.families == (DECODE,)), min(export.decode_batch),
                         max_seqs, per_family, grid, ratio)
    prefill = _best_rungs(Counter(s.tokens for s in steps if s.families != (DECODE,)), min(export.prefill_tokens),
                          max_tokens, per_family - len(verify), grid, ratio)
    total = budget.max_gears if budget.max_gears is not None else budget.max_gears_per_family * 2
    best: tuple[float, int, list[int], list[int]] | None = None
    for cost_d, rungs_d in decode:
        for cost_p, rungs_p in prefill:
            size = len(rungs_d) + len(rungs_p)
            if (size + len(verify)) * m <= total and (best is None or (cost_d + cost_p, size) < best[:2]):
                best = (cost_d + cost_p, size, rungs_d, rungs_p)
    if best is None:
        raise ValueError(f"max_gears = {total} (max_gears_per_family = {budget.max_gears_per_family}) cannot hold the fewest rungs that cover the limits (decode B up to {max_seqs}, prefill T "
                         f"up to {max_tokens}, each rung at most {ratio:g}x the one before) at each of the {m} "
                         "context-block sizes: raise the budget or max_rung_ratio, or lower context_gears")
    ladders = Ladders(tuple(best[2]), tuple(best[3]), export.prefill_max_seqs, tuple(context[-1][1]),
                      export.verify_tokens)
    return LadderPlan(ladders, padding(steps, ladders.gears(), even), padding(steps, old_gears, even), export,
                      effective, budget, len(requests), sum(r.prompt_tokens for r in requests),
                      sum(r.completion_tokens for r in requests))


def _best_rungs(sizes: Counter[int], floor: int, top: int, most: int, grid: int,
                ratio: float) -> list[tuple[float, list[int]]]:
    """For k = 1 .. `most` rungs: the least total padding of `sizes` (size -> steps) up to the smallest rung that
    holds each, and those rungs: the first at most `floor`, `top` the last, each at most `ratio` times the one
    before, so a size the trace never showed pads at most that much. Infeasible sizes k are left out.

    Rungs sit on the sizes or on the points floor, floor * ratio, ... up to top (a rung anywhere else pads more
    than the candidate above it), so with the candidates sorted, best[k][j] = min over p < j with
    v[j] <= ratio * v[p] of best[k-1][p] + the padding of the sizes in (v[p], v[j]] up to v[j]."""
    step = max(grid, -(-top // MAX_DISTINCT_SIZES))

    def up(size: int) -> int:
        return min(-(-size // step) * step, top)

    rounded: Counter[int] = Counter()  # the floor is kept exact: B = 1 serves single streams without batch invariance
    for size, count in sizes.items():
        rounded[up(size)] += count
    rounded[floor] += 0
    point = floor
    while point < top:
        rounded[up(point)] += 0
        point = max(point + 1, int(point * ratio))
    rounded[top] += 0
    values = np.array(sorted(rounded), dtype=np.float64)
    weights = np.array([rounded[int(v)] for v in values], dtype=np.float64)
    n = len(values)
    cum_w = np.concatenate([[0.0], np.cumsum(weights)])
    cum_s = np.concatenate([[0.0], np.cumsum(weights * values)])
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    # pad[i, j]: the sizes i..j padded up to v[j]; infinite where i > j
    pad = np.where(i <= j, values[None, :] * (cum_w[j + 1] - cum_w[i]) - (cum_s[j + 1] - cum_s[i]), np.inf)
    reach = values[None, :] <= ratio * values[:-1, None]  # [p, j]: a rung at v[j] may follow one at v[p]
    cost = np.where(values <= floor, pad[0], np.inf)
    choices: list[np.ndarray] = []
    results = [(float(cost[-1]), [int(values[-1])])]
    cols = np.arange(n)
    for _ in range(1, min(most, n)):
        options = np.where(reach, cost[:-1, None] + pad[1:, :], np.inf)
        arg = options.argmin(axis=0)
        cost = options[arg, cols]
        choices.append(arg)
        rungs, at = [n - 1], n - 1
        for back in reversed(choices):
            at = int(back[at])
            rungs.append(at)
        results.append((float(cost[-1]), [int(values[r]) for r in reversed(rungs)]))
    return [r for r in results if np.isfinite(r[0])]
