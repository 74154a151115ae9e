"""Benchmark results as a text table, a markdown table and a PNG plot (matplotlib, the `bench` extra)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np

Row = tuple[str, str, str, str]  # figure, paged, comparison, paged / comparison

_FIGURES: list[tuple[str, str, Callable[[float], str]]] = [
    ("throughput_tok_s", "total tok/s (throughput)", lambda v: f"{v:.1f}"),
    ("output_tok_s", "output tok/s", lambda v: f"{v:.1f}"),
    ("total_s", "wall time s", lambda v: f"{v:.2f}"),
    ("cpu_s", "process CPU time s", lambda v: f"{v:.2f}"),
    ("cpu_utilization", "CPU utilization (1 = all cores ours)", lambda v: f"{v:.2f}"),
    ("ttft_p50_s", "TTFT p50 s", lambda v: f"{v:.3f}"),
    ("ttft_p99_s", "TTFT p99 s", lambda v: f"{v:.3f}"),
    ("itl_p50_s", "inter-token p50 s", lambda v: f"{v:.4f}"),
    ("itl_p99_s", "inter-token p99 s", lambda v: f"{v:.4f}"),
    ("kv_utilization", "KV utilization", lambda v: f"{v:.3f}"),
    ("context_fill", "context fill (attention)", lambda v: f"{v:.3f}"),
    ("padding_waste", "padding waste", lambda v: f"{v:.3f}"),
    ("host_overhead_share", "host overhead share", lambda v: f"{v:.3f}"),
    ("mean_step_s", "mean step s", lambda v: f"{v:.4f}"),
    ("steps", "steps", lambda v: f"{v:.0f}"),
    ("kv_cache_bytes", "KV cache MiB", lambda v: f"{v / 2**20:.0f}"),
    ("kv_cache_blocks", "KV cache blocks", lambda v: f"{v:.0f}"),
    ("preemptions", "preemptions", lambda v: f"{v:.0f}"),
    ("peak_rss_bytes", "peak RSS MiB", lambda v: f"{v / 2**20:.0f}"),
]

_STRESS_FIGURES: list[tuple[str, str, Callable[[float], str]]] = [
    ("itl_max_s", "inter-token max s (decoders)", lambda v: f"{v:.3f}"),
    ("itl_p99_over_p50", "inter-token p99 / p50 (decoders)", lambda v: f"{v:.2f}"),
    ("long_prompt_ttft_s", "long prompt TTFT s", lambda v: f"{v:.2f}"),
]
_COMPARISONS = {"shared-prefix": ("cache_off", "cache off"), "stress": ("chunking_off", "chunking off")}


def _comparison(results: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """With speculative decoding on, the same workload with it off; else the workload's own comparison."""
    key, name = ("spec_off", "spec off") if "spec_off" in results else \
        _COMPARISONS.get(results["workload"], ("naive", "naive"))
    return name, results.get(key) or {}


def _row(label: str, ours: float | None, theirs: float | None, fmt: Callable[[float], str]) -> Row:
    ratio = f"{ours / theirs:.2f}x" if ours is not None and theirs else ""
    return (label, fmt(ours) if ours is not None else "-", fmt(theirs) if theirs is not None else "-", ratio)


def rows(results: dict[str, Any]) -> tuple[str, list[Row]]:
    """The comparison column: the naive baseline, prefix caching off (shared-prefix) or chunking off (stress)."""
    name, other = _comparison(results)
    figures = _FIGURES + _STRESS_FIGURES if results["workload"] == "stress" else _FIGURES
    table = [_row(label, results.get(key), other.get(key), fmt) for key, label, fmt in figures]
    if "prefix_hit_rate" in results:
        table.append(_row("prefix hit rate", results["prefix_hit_rate"], other.get("prefix_hit_rate"),
                          lambda v: f"{v:.3f}"))
    spec = results.get("spec_decode")
    if spec is not None:
        table.append(_row("speculation: acceptance rate", spec["acceptance_rate"], None, lambda v: f"{v:.3f}"))
        table.append(_row("speculation: mean acceptance length", spec["mean_acceptance_length"], None,
                          lambda v: f"{v:.2f}"))
    cost = results.get("batch_invariance_cost")
    if cost is not None:
        table.append(_row(f"batch_invariant on / off: throughput tok/s, means of {cost['rounds']} rounds",
                          float(np.mean(cost["throughput_tok_s_on"])), float(np.mean(cost["throughput_tok_s_off"])),
                          lambda v: f"{v:.1f}"))
    for ctx, seconds in results.get("decode_step_s", {}).items():
        table.append(_row(f"decode step s, B={results['options']['decode_batch']}, context {ctx}", seconds,
                          results.get("naive_decode_step_s", {}).get(ctx), lambda v: f"{v:.4f}"))
    if "decode_step_s_one_long" in results:
        contexts = results["options"]["contexts"]
        table.append(_row(f"decode step s, {results['options']['decode_batch'] - 1} x {min(contexts)} + 1 x "
                          f"{max(contexts)}", results["decode_step_s_one_long"], None, lambda v: f"{v:.4f}"))
    if "structured_output" in results:
        cost = results["structured_output"]
        table.append(_row(f"structured output: mask s / decode step s, B={results['options']['decode_batch']}",
                          cost["mask_s_per_step"], cost["constrained_step_s"], lambda v: f"{v:.4f}"))
    for n, tok_s in results.get("decode_tok_s", {}).items():
        table.append(_row(f"decode tok/s, {n} concurrent", tok_s, results.get("naive_decode_tok_s", {}).get(n),
                          lambda v: f"{v:.1f}"))
    return name, table


def _executor(results: dict[str, Any]) -> str:
    """The paged engine's executor, and for ONNX Runtime whether the custom ops ran: they change every figure."""
    active = results["custom_ops"]
    precision = (f", {results.get('dtype', 'float32')}, quantization {results.get('quantization', 'none')}, "
                 f"KV cache {results.get('kv_cache_dtype', 'float32')}")
    return (f"executor {results['executor']}" + ("" if active is None else f", custom ops {'on' if active else 'off'}")
            + precision)


def text_table(results: dict[str, Any]) -> str:
    name, table = rows(results)
    lines = [("figure", "paged", name, "paged/" + name), *table]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join([f"paged engine: {_executor(results)}"] + [
        f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}" for a, b, c, d in lines])


def markdown_table(results: dict[str, Any]) -> str:
    name, table = rows(results)
    machine = results["machine"]
    lines = [f"Workload `{results['workload']}`, {results['requests']} requests "
             f"({results['prompt_tokens']} prompt + {results['output_tokens']} output tokens), paged engine "
             f"{_executor(results)}; {machine['cores']} cores ({machine['cpu']}), onnxruntime {machine['onnxruntime']}, "
             f"load average {machine['load_avg_1m_at_start']:.1f} at start, {machine['load_avg_1m_at_end']:.1f} "
             f"at end.", "", f"| figure | paged | {name} | paged / {name} |", "|---|---:|---:|---:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in table]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    name, other = _comparison(results)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    ax = axes[0][0]
    ax.bar(["paged", name], [results["throughput_tok_s"], other.get("throughput_tok_s", 0)], color=["C0", "C1"])
    ax.set_title(f"{results['workload']}: total tokens/s")
    ax = axes[0][1]
    keys = ["ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s"]
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [results[k] for k in keys], 0.4, label="paged")
    ax.bar([x + 0.2 for x in xs], [other.get(k, 0) for k in keys], 0.4, label=name)
    ax.set_xticks(list(xs), ["TTFT p50", "TTFT p99", "ITL p50", "ITL p99"])
    ax.set_yscale("log")
    ax.set_title("latency (s, log)")
    ax.legend()
    for ax, key, title in ((axes[1][0], "decode_tok_s", "decode tokens/s vs concurrent requests"),
                           (axes[1][1], "decode_step_s", "decode step s vs context tokens")):
        for label, series in (("paged", results.get(key)), ("naive", results.get("naive_" + key))):
            if series:
                ax.plot([int(k) for k in series], list(series.values()), marker="o", label=label)
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"pagedgraph bench on {results['machine']['cores']} cores ({results['machine']['cpu']})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
