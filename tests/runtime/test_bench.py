"""`pagedgraph bench` on the real model with tiny workloads: keys and sane figures, never timings."""
from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from pagedgraph.artifact.manifest import ArtifactError
from pagedgraph.runtime.bench import workloads
from pagedgraph.runtime.bench.metrics import resident_bytes
from pagedgraph.runtime.bench.naive import NAIVE_GRAPH, NaiveRunner
from pagedgraph.runtime.bench.report import markdown_table, text_table
from pagedgraph.runtime.bench.runner import run_engine
from pagedgraph.runtime.bench.suite import BenchOptions, run_bench
from pagedgraph.runtime.engine import LLMEngine

pytestmark = pytest.mark.e2e
REQUIRED = {"throughput_tok_s", "naive_throughput_tok_s", "speedup_vs_naive", "kv_utilization", "padding_waste",
            "host_overhead_share", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "peak_rss_bytes",
            "output_tok_s", "total_tok_s", "bucket_hits", "decode_step_s", "decode_tok_s"}
TINY = dict(requests=5, prompt_range=(8, 80), output_range=(2, 6), naive_batch=4, contexts=(16, 48), decode_batch=4,
            concurrency=(1, 2), concurrency_prompt=8, concurrency_tokens=4)


def test_mixed_is_reproducible_and_in_range() -> None:
    first = workloads.mixed(49152, 64, seed=3)
    assert first == workloads.mixed(49152, 64, seed=3)
    prompts = [len(r.prompt_token_ids) for r in first]
    assert min(prompts) >= 8 and max(prompts) <= 1024 and np.median(prompts) < 300  # log-uniform: mostly short
    assert all(16 <= r.max_tokens <= 256 and r.arrival_s == 0 for r in first)
    arrivals = [r.arrival_s for r in workloads.poisson(first, rate=4.0)]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and 8 < arrivals[-1] < 32  # 63 gaps of mean 0.25 s


def test_resident_bytes_counts_the_pages_written() -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    # Fresh anonymous mappings, as the KV pools are (runtime/kv_pools.py). np.zeros may hand back heap pages that
    # earlier code in the process touched: after torch or ORT moved glibc's mmap threshold, 48 MiB came resident.
    pools = [np.frombuffer(mmap.mmap(-1, 48 << 20), np.float32) for _ in range(2)]
    before = resident_bytes(pools)
    assert before == 0
    pools[0][page // 4 : 4 * page // 4 : page // 4] = 1.0  # one float on each of pages 1, 2, 3
    pools[1][-1] = 1.0
    assert resident_bytes(pools) - before == 4 * page


def test_mixed_needs_a_long_enough_artifact() -> None:
    with pytest.raises(ValueError, match=r"max_model_len is 1024; re-export with export.max_model_len >= \d+"):
        workloads.check_fits(workloads.mixed(49152, 64), 1024, "mixed")


def test_poisson_bench_against_naive(smollm2_artifact: Path) -> None:
    results = run_bench(BenchOptions(str(smollm2_artifact), workload="poisson", rate=50.0, **TINY))
    assert REQUIRED <= results.keys()
    json.dumps(results)  # JSON-ready as it is
    naive = results["naive"]
    for figures in (results, naive):
        assert figures["requests"] == 5 and figures["output_tokens"] > 0 and figures["throughput_tok_s"] > 0
        assert 0 < figures["kv_utilization"] <= 1
        assert figures["padding_waste"] >= 0 and 0 <= figures["host_overhead_share"] < 1
        assert 0 < figures["ttft_p50_s"] <= figures["ttft_p99_s"] and 0 < figures["itl_p50_s"] <= figures["itl_p99_s"]
        assert sum(figures["bucket_hits"].values()) == figures["steps"]
    assert results["speedup_vs_naive"] == pytest.approx(results["throughput_tok_s"] / results["naive_throughput_tok_s"])
    assert naive["kv_utilization"] < results["kv_utilization"]  # 5 short requests in 4 x 1280-slot rows
    assert results["peak_rss_bytes"] > results["weights_bytes"]
    # 5 requests write a few blocks of the 1 GiB pool: only those pages are resident
    assert 0 < results["kv_cache_resident_bytes"] < results["kv_cache_bytes"] // 10
    assert results["rss_beyond_kv_bytes"] == results["peak_rss_bytes"] - results["kv_cache_resident_bytes"]
    assert set(results["decode_step_s"]) == set(results["naive_decode_step_s"]) == {"16", "48"}
    assert results["decode_step_s_one_long"] > 0
    assert set(results["decode_tok_s"]) == {"1", "2"} and all(v > 0 for v in results["naive_decode_tok_s"].values())
    cost = results["structured_output"]  # the grammar masks of 4 constrained sequences, inside their step
    assert 0 < cost["mask_s_per_step"] < cost["constrained_step_s"] and cost["unconstrained_step_s"] > 0
    assert "structured output: mask s / decode step s" in text_table(results)
    assert results["custom_ops"] is True  # "auto", and scripts/test.sh fetched the header the custom ops need
    assert "| padding waste |" in markdown_table(results) and "paged/naive" in text_table(results)
    assert "executor onnxruntime, custom ops on, float32, quantization none" in text_table(results)
    # ORT's profile names the kernels that ran: fp32 linears are Gemm, the fused attention its custom op.
    decode = results["kernels"]["decode"]["ops"]
    assert decode["Gemm"]["calls"] == 4 * 30 + 1 and decode["PagedAttention"]["calls"] == 30
    assert results["kernels"]["matmul_nbits"] == [] and results["kernels"]["custom_ops"] is True


def test_shared_prefix_compares_cache_on_and_off(smollm2_artifact: Path) -> None:
    options = BenchOptions(str(smollm2_artifact), workload="shared-prefix", requests=3, prefix_words=120,
                           baseline=None, micro=False, custom_ops="off")
    results = run_bench(options)
    assert results["custom_ops"] is False and "custom ops off" in markdown_table(results)
    for key in ("ttft_p50_s", "ttft_p50_s_cache_off", "total_s", "total_s_cache_off"):
        assert results[key] > 0
    assert results["prefix_hit_rate"] > 0.3 and results["cache_off"]["prefix_hit_rate"] == 0
    assert "naive" not in results and "decode_step_s" not in results


def test_batch_invariance_cost_alternates_both_engines_on_fresh_requests(smollm2_artifact: Path) -> None:
    options = BenchOptions(str(smollm2_artifact), requests=3, prompt_range=(8, 40), output_range=(2, 4), baseline=None,
                           micro=False, invariance_rounds=2)
    results = run_bench(options)
    cost = results["batch_invariance_cost"]
    assert len(cost["throughput_tok_s_on"]) == len(cost["throughput_tok_s_off"]) == len(cost["ratio_per_round"]) == 2
    assert cost["throughput_ratio"] > 0 and cost["cpu_ratio"] > 0
    assert "batch_invariant on / off" in text_table(results)


def test_naive_baseline_generates_what_the_engine_generates(smollm2_artifact: Path) -> None:
    """The contiguous-cache lowering of the same model: greedy tokens equal the paged engine's."""
    engine = LLMEngine(smollm2_artifact)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away, there lived"]
    requests = [workloads.BenchRequest(engine.tokenizer.encode(p), 8) for p in prompts]
    paged = run_engine(engine, requests).outputs
    naive = NaiveRunner(smollm2_artifact, batch_size=2).run(requests).outputs  # two static batches, padded
    assert [naive[i] for i in range(3)] == [paged[f"bench-{i}"] for i in range(3)]


def test_naive_needs_the_baseline_graph(smollm2_artifact: Path, tmp_path: Path) -> None:
    manifest = json.loads((smollm2_artifact / "manifest.json").read_text())
    del manifest["files"][NAIVE_GRAPH]
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="export.baseline: naive"):
        NaiveRunner(tmp_path)


def test_stress_compares_chunked_prefill_on_and_off(smollm2_artifact: Path) -> None:
    shape = workloads.StressShape(decoder_prompt=16, decoder_tokens=24, long_prompt=600, long_tokens=3,
                                  long_arrival_s=0.3)
    results = run_bench(BenchOptions(str(smollm2_artifact), workload="stress", requests=4, chunk_tokens=48,
                                     stress=shape, baseline=None, micro=False))
    json.dumps(results)
    for suffix in ("", "_chunking_off"):
        assert 0 < results["itl_p50_s" + suffix] <= results["itl_p99_s" + suffix] <= results["itl_max_s" + suffix]
        assert results["long_prompt_ttft_s" + suffix] > 0 and results["total_s" + suffix] > 0
    assert results["requests"] == 4 and results["output_tokens"] == 3 * 24 + 3
    chunk_steps = sum(n for gear, n in results["bucket_hits"].items() if gear.startswith("prefill:T64x"))
    assert chunk_steps >= 600 // 48, "the long prompt is fed in chunks of 48 tokens beside the decodes"
    assert any(gear.startswith("prefill:T1024x") for gear in results["chunking_off"]["bucket_hits"]), \
        "with chunking off the long prompt runs whole"
    assert "| long prompt TTFT s |" in markdown_table(results) and "paged/chunking off" in text_table(results)


def test_stress_has_no_naive_baseline() -> None:
    with pytest.raises(ValueError, match="--baseline none --no-micro"):
        BenchOptions("unused", workload="stress")
