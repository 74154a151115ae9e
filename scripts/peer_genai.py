"""Decode tok/s of onnxruntime-genai beside our engine: same model, same prompts, same process.

onnxruntime-genai is a peer on the same ONNX Runtime; this measures both at 1 to 16 concurrent requests,
alternately in one process, so the ratio holds when other processes take the cores.
For N in --counts, N requests of --prompt-tokens random ids (>= 100, fixed seed) each generate
exactly --max-tokens tokens greedily (EOS cannot stop them). genai serves them as one static batch
of N; our engine serves them with `pagedgraph.runtime.bench.runner.run_engine`, as `micro.engine_concurrency`
does. Both figures are `micro.decode_tok_s`: tokens after every request's first, per second.
Every run has fresh prompts (the next seed), the same for both engines, which take turns going
first; the best of --rounds is reported. Equal lengths are static batching's best case: this part
compares the engines' steps.

--serve adds what continuous batching is for: 2N requests of varied lengths (prompts of 16-128
tokens, outputs of 16-256) from N concurrent clients. genai serves them as static batches of N
(prompts right-padded with its pad token, as it expects; every batch runs until its longest output
is done); our engine keeps N requests in flight, admitting the next one as soon as one finishes.
Figure: requested output tokens per second of wall time, prefill included.

A measurement script only: nothing in the tests or the runtime imports it.

Building the genai model (needs torch, transformers, onnxruntime-genai; HF_HUB_OFFLINE=1 makes sure
nothing is downloaded; the same commands give byte-identical files):

    HF_HUB_OFFLINE=1 python scripts/peer_genai.py --make-hf artifacts/genai-hf  # the bundled GGUF as fp32 HF
    pip install onnx-ir  # the builder's one extra dependency (1.1.0 here; a venv keeps it apart)
    HF_HUB_OFFLINE=1 python -m onnxruntime_genai.models.builder -i artifacts/genai-hf -o artifacts/genai-model \\
        -p fp32 -e cpu -c artifacts/genai-cache

Measuring (the machine should be idle):

    python scripts/peer_genai.py --artifact artifacts/smollm2-bench --genai-model artifacts/genai-model \\
        --threads 2 --serve --json docs/bench/peer_genai.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pagedgraph.runtime.bench import micro  # noqa: E402
from pagedgraph.runtime.bench.metrics import RunRecord  # noqa: E402
from pagedgraph.runtime.bench.runner import bench_params, run_engine, warm_up  # noqa: E402
from pagedgraph.runtime.bench.workloads import FIRST_PLAIN_TOKEN, BenchRequest  # noqa: E402
from pagedgraph.runtime.engine import EngineConfig, LLMEngine  # noqa: E402


def make_hf_dir(out: Path) -> None:
    """The bundled GGUF as a plain fp32 transformers directory, the input genai's builder reads.

    transformers dequantizes the GGUF on load but then refuses to save a "quantized" model, so the
    weights move into a fresh model built from the same config without its quantization entry.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path

    path = Path(default_model_path())
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype="float32")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype="float32")
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)


class GenaiRunner:
    """onnxruntime-genai's Generator over one static batch: every request starts and ends together."""

    def __init__(self, model_dir: Path, threads: int | None) -> None:
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(model_dir))
        if threads:
            config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.pad = json.loads((model_dir / "genai_config.json").read_text())["model"]["pad_token_id"]
        self.run([BenchRequest(list(range(100, 108)), 2)])  # session start-up, as runner.warm_up

    def generate(self, requests: list[BenchRequest], on_token: Callable[[], None] = lambda: None) -> list[list[int]]:
        """One static batch, greedy, prompts right-padded with the pad token (genai's convention); every request
        computes max(max_tokens) tokens (min_length = max_length: EOS cannot stop it). `on_token` runs after each."""
        width = max(len(r.prompt_token_ids) for r in requests)
        total = width + max(r.max_tokens for r in requests)
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(do_sample=False, min_length=total, max_length=total, batch_size=len(requests))
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array([r.prompt_token_ids + [self.pad] * (width - len(r.prompt_token_ids))
                                          for r in requests], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()  # the first only samples the prompt's logits; later ones run a step
            on_token()
        return [generator.get_sequence(key)[width:width + r.max_tokens].tolist() for key, r in enumerate(requests)]

    def run(self, requests: list[BenchRequest]) -> RunRecord:
        """One static batch of equal requests, every token timed, as run_engine times ours."""
        record = RunRecord(requests=len(requests), prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
                           output_tokens=sum(r.max_tokens for r in requests))
        keys = [f"bench-{i}" for i in range(len(requests))]
        start = time.perf_counter()
        for key in keys:
            record.timeline.arrive(key, start)

        def tokens() -> None:
            now = time.perf_counter()
            for key in keys:
                record.timeline.tokens(key, 1, now)

        record.outputs = dict(zip(keys, self.generate(requests, tokens)))
        record.wall_s = time.perf_counter() - start
        return record


# One engine's figure for one run (tok/s) and its outputs by request id; a run that gives it.
Outcome = tuple[float, dict[str, list[int]]]
Run = Callable[[], Outcome]


def serve_genai(genai: GenaiRunner, requests: list[BenchRequest], concurrency: int) -> Outcome:
    """Static batches of `concurrency` requests, one after another: output tok/s and the outputs."""
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for first in range(0, len(requests), concurrency):
        batch = genai.generate(requests[first:first + concurrency])
        outputs.update({f"bench-{first + i}": tokens for i, tokens in enumerate(batch)})
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start), outputs


def serve_engine(engine: LLMEngine, requests: list[BenchRequest], concurrency: int) -> Outcome:
    """`concurrency` clients, each sending its next request when the last one finished: tok/s and outputs."""
    pending = list(enumerate(requests))[::-1]
    outputs: dict[str, list[int]] = {}
    in_flight = 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < concurrency:
            index, request = pending.pop()
            engine.add_request(request.prompt_token_ids, bench_params(request.max_tokens), f"bench-{index}")
            in_flight += 1
        for out in engine.step():
            if out.error:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            if out.finished:
                outputs[out.request_id] = list(out.token_ids)
                in_flight -= 1
    return sum(r.max_tokens for r in requests) / (time.perf_counter() - start), outputs


SERVE_PROMPT_TOKENS, SERVE_MAX_TOKENS = (16, 128), (16, 256)  # --serve's lengths, uniform, inclusive


def varied_requests(vocab_size: int, count: int, seed: int) -> list[BenchRequest]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(*SERVE_PROMPT_TOKENS, size=count, endpoint=True)
    outputs = rng.integers(*SERVE_MAX_TOKENS, size=count, endpoint=True)
    return [BenchRequest(rng.integers(FIRST_PLAIN_TOKEN, vocab_size, length).tolist(), int(max_tokens))
            for length, max_tokens in zip(lengths, outputs)]


def agreement(ours: dict[str, list[int]], theirs: dict[str, list[int]]) -> list[int]:
    """Per request, how many leading greedy tokens the two engines share (fp32 rounding may split near-ties)."""
    shared = []
    for key, tokens in theirs.items():
        mine = ours[key]
        shared.append(next((i for i, (a, b) in enumerate(zip(mine, tokens)) if a != b), min(len(mine), len(tokens))))
    return shared


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def environment(genai_model: Path, threads: int | None) -> dict[str, Any]:
    """Versions (transformers and torch made the HF directory genai's model was built from) and genai's config."""
    import onnxruntime as ort

    packages = {name: _version(name) for name in ("onnxruntime", "onnxruntime-genai", "numpy", "transformers", "torch")}
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), **packages, "threads": threads or "each engine's default",
            "ort_default_providers": ort.get_available_providers(), "genai_model": str(genai_model),
            "genai_config": json.loads((genai_model / "genai_config.json").read_text())}



def measure(args: argparse.Namespace, log: Any) -> tuple[dict[str, Any], bool | None]:
    """Per workload and N, both engines' tok/s and greedy agreement; and whether our custom ops ran."""
    genai = GenaiRunner(Path(args.genai_model), args.threads)
    engine = LLMEngine(args.artifact, EngineConfig(threads=args.threads, custom_ops=args.custom_ops))
    warm_up(engine)
    vocab = engine.model.vocab_size

    def equal(n: int, seed: int) -> dict[str, Run]:
        requests = micro.random_requests(vocab, n, args.prompt_tokens, args.max_tokens, seed)
        return {"genai": lambda: decoded(genai.run(requests)),
                "pagedgraph": lambda: decoded(run_engine(engine, requests))}

    def serve(n: int, seed: int) -> dict[str, Run]:
        requests = varied_requests(vocab, 2 * n, seed)
        return {"genai": lambda: serve_genai(genai, requests, n),
                "pagedgraph": lambda: serve_engine(engine, requests, n)}

    results = {"equal": compare(args, "equal", equal, args.seed, args.max_tokens, log)}
    if args.serve:
        results["serve"] = compare(args, "serve", serve, args.seed + 1000, None, log)
    return results, engine.runner.executor.custom_ops


def decoded(record: RunRecord) -> Outcome:
    return micro.decode_tok_s(record), record.outputs


def compare(args: argparse.Namespace, label: str, runs_of: Callable[[int, int], dict[str, Run]], seed: int,
            of: int | None, log: Any) -> dict[str, Any]:
    """--rounds rounds over --counts; every run has fresh requests (the next seed: no prefix-cache hits
    on earlier ones), the same for both engines, which take turns going first."""
    runs: dict[int, dict[str, list[float]]] = {n: {"genai": [], "pagedgraph": []} for n in args.counts}
    shared: dict[int, list[int]] = {n: [] for n in args.counts}
    seeds = itertools.count(seed)
    for round_index in range(args.rounds):
        for n in args.counts:
            engines = list(runs_of(n, next(seeds)).items())
            outputs = {}
            for name, run in engines[::-1] if round_index % 2 else engines:
                tok_s, outputs[name] = run()
                runs[n][name].append(tok_s)
            shared[n].extend(agreement(outputs["pagedgraph"], outputs["genai"]))
            print(f"{label} round {round_index + 1} N={n}: genai {runs[n]['genai'][-1]:.1f} tok/s, "
                  f"pagedgraph {runs[n]['pagedgraph'][-1]:.1f} tok/s (load {os.getloadavg()[0]:.2f})", file=log)
    return summary(runs, shared, of)


def summary(runs: dict[int, dict[str, list[float]]], shared: dict[int, list[int]], of: int | None) -> dict[str, Any]:
    """Per N: every run, the best of each engine, their ratio and greedy agreement."""
    results = {}
    for n, by_engine in runs.items():
        best = {name: max(values) for name, values in by_engine.items()}
        results[str(n)] = {"genai_tok_s": by_engine["genai"], "pagedgraph_tok_s": by_engine["pagedgraph"],
                           "genai_best": best["genai"], "pagedgraph_best": best["pagedgraph"],
                           "ratio_pagedgraph_over_genai": best["pagedgraph"] / best["genai"],
                           "greedy_tokens_shared_min": min(shared[n]),
                           "greedy_tokens_shared_mean": sum(shared[n]) / len(shared[n]),
                           "greedy_tokens_shared_of": of or "each request's max_tokens"}
    return results


def table(results: dict[str, Any]) -> str:
    lines = ["| N | genai tok/s (best; runs) | pagedgraph tok/s (best; runs) | pagedgraph / genai |",
             "|---:|---|---|---:|"]
    for n, r in results.items():
        cells = [f"{r[k + '_best']:.1f} ({', '.join(f'{v:.1f}' for v in r[k + '_tok_s'])})"
                 for k in ("genai", "pagedgraph")]
        lines.append(f"| {n} | {cells[0]} | {cells[1]} | {r['ratio_pagedgraph_over_genai']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-hf", type=Path, help="write the fp32 HF directory for genai's builder, then exit")
    parser.add_argument("--artifact", default="artifacts/smollm2-bench", help="ours, exported by scripts/bench.sh")
    parser.add_argument("--genai-model", default="artifacts/genai-model", help="built as the docstring says")
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    # Set it: genai left to its default ran one core's worth here (29 vs 45 tok/s single-stream at 2 threads).
    parser.add_argument("--threads", type=int, help="intra-op threads for both engines (default: each one's own)")
    parser.add_argument("--custom-ops", choices=["auto", "on", "off"], default="auto",
                        help="our ONNX Runtime custom ops (executor.custom_ops)")
    parser.add_argument("--serve", action="store_true",
                        help="also 2N varied requests from N concurrent clients (continuous vs static batching)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.make_hf:
        make_hf_dir(args.make_hf)
        return
    if not (Path(args.genai_model) / "genai_config.json").exists():
        parser.error(f"--genai-model {args.genai_model}: no genai_config.json there; build it as the docstring says")
    load_start = os.getloadavg()[0]
    results, custom_ops = measure(args, sys.stderr)
    print(f"pagedgraph custom ops: {'on' if custom_ops else 'off'}")
    for mode, by_n in results.items():
        print(f"{mode}:\n{table(by_n)}")
    if args.json:
        out = {"environment": environment(Path(args.genai_model), args.threads),
               "load_avg_1m": {"start": load_start, "end": os.getloadavg()[0]},
               "workload": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                            "rounds": args.rounds, "seed": args.seed, "artifact": args.artifact,
                            "serve": {"requests": "2N", "prompt_tokens": SERVE_PROMPT_TOKENS,
                                      "max_tokens": SERVE_MAX_TOKENS, "figure": "requested output tokens / wall s"}
                            if args.serve else None},
               "pagedgraph_custom_ops": custom_ops,
               "results": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
