"""Single-stream decode tok/s of llama.cpp (llama-cpp-python) beside our artifacts: same GGUF, same threads, one run.

One request of --prompt-tokens random ids (>= 100, fixed seed) generates exactly --max-tokens tokens greedily
(EOS cannot stop it). Figure: tokens after the first, per second of that decode phase (`micro.decode_tok_s`
for our engine; the same definition timed around llama.cpp's `generate`). Engines take turns, each round gets
fresh prompts (the next seed, the same for every engine); the best of --rounds is reported.

A measurement script only: nothing in the tests or the runtime imports it. llama-cpp-python builds llama.cpp
from source with native flags, into a venv that sees ours (its site-packages then go on PYTHONPATH):

    python -m venv --system-site-packages LLAMA_VENV
    CMAKE_ARGS="-DGGML_NATIVE=ON" LLAMA_VENV/bin/pip install --no-deps llama-cpp-python diskcache

A GGUF of an HF checkpoint at llama.cpp's 8-bit form (Q8_0, for our w8a8) comes from the convert_hf_to_gguf.py
that the llama-cpp-python sdist carries (`pip download --no-deps --no-binary :all: llama-cpp-python`, then its
vendor/llama.cpp; it needs sentencepiece importable even for a BPE tokenizer, and its gguf-py on PYTHONPATH):

    PYTHONPATH=vendor/llama.cpp/gguf-py python vendor/llama.cpp/convert_hf_to_gguf.py HF --outtype q8_0 --outfile Q8.gguf

Measuring (the machine should be idle; artifacts exported with --quantization none / gguf):

    python scripts/peer_llamacpp.py --artifact artifacts/fp32 --artifact artifacts/gguf --threads 2 \\
        --json docs/bench/peer_llamacpp.json

--workload copy compares speculative decoding instead: `pagedgraph bench --workload copy`'s 9 chats (the artifact's
chat template applied once by scripts/peer_workload.py, the same token ids fed to every engine), served one at a
time, greedy, exactly each request's max_tokens. llama.cpp runs without a draft and with llama-cpp-python's prompt
lookup (`LlamaPromptLookupDecoding`: its n-gram proposer in Python, verified by one llama.cpp batch per step);
each artifact runs without speculation and with --speculative-config, each run on a fresh engine configured as
`pagedgraph bench --workload copy` configures it but with prefix caching off: every engine computes every prompt
whole. The figure is `pagedgraph bench`'s output_tok_s (output tokens per second of wall time, prefill
included), best of --rounds; also each engine's acceptance and whether its output with speculation equals its own
without. Artifacts need export.buckets.verify_tokens for K+1 (docs/performance.md, "Speculative decoding"):

    python scripts/peer_llamacpp.py --workload copy --artifact FP32 --artifact GGUF --threads 2 \\
        --json docs/bench/spec_peers.json
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import deque
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

import peer_workload
from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path
from pagedgraph.runtime.bench import micro
from pagedgraph.runtime.bench.runner import run_engine, warm_up
from pagedgraph.runtime.bench.suite import WORKLOAD_CONFIG
from pagedgraph.runtime.bench.workloads import FIRST_PLAIN_TOKEN, BenchRequest
from pagedgraph.runtime.engine import EngineConfig, LLMEngine
from pagedgraph.runtime.spec.speculator import SpecDecodeStats

# K=7 drafts of a 2-5 token match: the configuration docs/performance.md measured at 2.11x.
NGRAM = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def llama_cpp_tok_s(llm: Any, prompt: list[int], max_tokens: int) -> float:
    llm.reset()
    times = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == max_tokens:
            break
    return (len(times) - 1) / (times[-1] - times[0])


@dataclass
class CountedLookup:
    """llama-cpp-python's prompt lookup, keeping each proposal (its first position, its tokens) to count acceptance."""

    lookup: Any  # llama_cpp.llama_speculative.LlamaPromptLookupDecoding
    proposals: list[tuple[int, list[int]]] = field(default_factory=list)

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        draft = self.lookup(input_ids, **kwargs)
        if len(draft):
            self.proposals.append((len(input_ids), draft.tolist()))
        return draft

    def count(self, sequence: list[int], stats: SpecDecodeStats) -> None:
        """Add this request's proposals to `stats`: under greedy a drafted token is kept iff it is the output's.

        A proposal's tokens past the end of `sequence` (prompt + output) were never verified and are not counted."""
        for start, draft in self.proposals:
            draft = draft[:len(sequence) - start]
            if not draft:
                continue
            kept = next((i for i, token in enumerate(draft) if sequence[start + i] != token), len(draft))
            stats.num_drafts += 1
            stats.num_draft_tokens += len(draft)
            stats.num_accepted_tokens += kept
        self.proposals.clear()


@dataclass
class LlamaCppStream:
    """One llama.cpp context serving peer_workload.serve's requests one at a time, a token per step, greedy."""

    llm: Any  # llama_cpp.Llama, its draft_model the CountedLookup (or none)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    queue: deque[tuple[str, peer_workload.PeerRequest]] = field(default_factory=deque)
    tokens: Iterator[int] | None = None

    def add(self, key: str, request: peer_workload.PeerRequest) -> None:
        self.queue.append((key, request))

    def step(self) -> Iterable[tuple[str, int, bool]]:
        key, request = self.queue[0]
        if self.tokens is None:
            self.llm.reset()  # no prefix kept from the previous request: each prompt is computed whole
            self.tokens = self.llm.generate(request.prompt_token_ids, top_k=1, temp=0.0, reset=True)
            self.outputs[key] = []
        output = self.outputs[key]
        output.append(next(self.tokens))
        finished = len(output) == request.max_tokens
        if finished:
            self.tokens.close()
            self.tokens = None
            self.queue.popleft()
            if self.llm.draft_model is not None:
                self.llm.draft_model.count(request.prompt_token_ids + output, self.stats)
        return [(key, 1, finished)]


def llama_cpp_copy(llm: Any, requests: list[peer_workload.PeerRequest]) -> tuple[dict[str, Any], list[list[int]]]:
    stream = LlamaCppStream(llm)
    figures = peer_workload.copy_figures(peer_workload.serve(requests, stream.add, stream.step))
    if llm.draft_model is not None:
        figures["spec_decode"] = stream.stats.to_dict()
    return figures, [stream.outputs[f"bench-{i}"] for i in range(len(requests))]


def ours_copy(artifact: str, threads: int, spec: dict[str, Any] | None,
              requests: list[peer_workload.PeerRequest]) -> tuple[dict[str, Any], list[list[int]], str]:
    """One run on a fresh engine, configured as `pagedgraph bench --workload copy` configures it, prefix caching off."""
    engine = LLMEngine(artifact, EngineConfig(threads=threads, speculative_config=spec, enable_prefix_caching=False,
                                              **WORKLOAD_CONFIG["copy"]))
    warm_up(engine)
    record = run_engine(engine, [BenchRequest(r.prompt_token_ids, r.max_tokens) for r in requests])
    figures = peer_workload.copy_figures(record)
    if spec:
        figures["spec_decode"] = record.extra["spec_decode"]
    return figures, [record.outputs[f"bench-{i}"] for i in range(len(requests))], engine.manifest.precision()


def copy_comparison(args: argparse.Namespace) -> dict[str, Any]:
    """Each engine without and with speculation, taking turns every round; the best round of each."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    gguf = args.gguf or str(default_model_path())
    requests = peer_workload.copy_requests(args.artifact[0])
    n_ctx = max(len(r.prompt_token_ids) + r.max_tokens for r in requests) + args.num_pred_tokens + 8
    lookup = CountedLookup(LlamaPromptLookupDecoding(max_ngram_size=args.max_ngram_size,
                                                     num_pred_tokens=args.num_pred_tokens))
    llms = {on: Llama(model_path=gguf, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=n_ctx,
                      n_batch=n_ctx, draft_model=lookup if on else None, verbose=False) for on in (False, True)}
    for llm in llms.values():  # start-up and first-call costs, as our runner's warm_up
        llama_cpp_copy(llm, [peer_workload.PeerRequest(requests[0].prompt_token_ids[:8], 2)])
    spec = json.loads(args.speculative_config)
    load_start = os.getloadavg()
    runs: dict[str, dict[str, list]] = {}
    precision = {"llama.cpp": f"the GGUF's own blocks ({Path(gguf).name}), llama.cpp's CPU kernels"}
    for round_ in range(args.rounds):
        for on in (False, True):
            figures, outputs = llama_cpp_copy(llms[on], requests)
            runs.setdefault("llama.cpp", {}).setdefault("on" if on else "off", []).append((figures, outputs))
        for artifact in args.artifact:
            for on in (False, True):
                figures, outputs, precision[artifact] = ours_copy(artifact, args.threads, spec if on else None,
                                                                  requests)
                runs.setdefault(artifact, {}).setdefault("on" if on else "off", []).append((figures, outputs))
        print(f"round {round_ + 1}: " + ", ".join(
            f"{name} {r['off'][-1][0]['output_tok_s']:.1f} / {r['on'][-1][0]['output_tok_s']:.1f}"
            for name, r in runs.items()) + " output tok/s off / on", flush=True)
    engines = {}
    for name, by_mode in runs.items():
        best = {mode: max(rounds, key=lambda run: run[0]["output_tok_s"])[0] for mode, rounds in by_mode.items()}
        off_outputs = by_mode["off"][0][1]
        engines[name] = {
            "precision": precision[name], "off": best["off"], "on": best["on"],
            "speedup": best["on"]["output_tok_s"] / best["off"]["output_tok_s"],
            "output_tok_s_rounds": {mode: [run[0]["output_tok_s"] for run in rounds] for mode, rounds in by_mode.items()},
            # Requests (of len(requests)) whose output with speculation equals the first run's without, every round.
            "outputs_equal_spec_off": sum(all(run[1][i] == off_outputs[i] for run in by_mode["on"] + by_mode["off"])
                                          for i in range(len(requests))),
        }
    return {"workload": "copy", "requests": len(requests), "output_tokens": sum(r.max_tokens for r in requests),
            "gguf": Path(gguf).name, "threads": args.threads, "rounds": args.rounds,
            "llama_cpp_lookup": {"class": "llama_cpp.llama_speculative.LlamaPromptLookupDecoding",
                                 "num_pred_tokens": args.num_pred_tokens, "max_ngram_size": args.max_ngram_size,
                                 "llama_cpp_python": version("llama_cpp_python")},
            "speculative_config": spec, "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
            "engines": engines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", action="append", required=True, help="our artifact (repeatable)")
    parser.add_argument("--kv-cache-dtype", action="append", dest="kv_cache_dtypes",
                        help="our engines' KV cache dtype (repeatable: each artifact runs with each; default: auto)")
    parser.add_argument("--gguf", help="the GGUF llama.cpp runs (default: the bundled SmolLM2 Q4_1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-batch", type=int, help="single: llama.cpp's prompt batch (default: the whole "
                        "prompt). 1 prefills a token at a time, the decode figure unchanged: a llama.cpp built here "
                        "with AMX died of SIGILL on batches of 4 or more tokens (2026-12-06, docs/performance.md)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--workload", choices=["single", "copy"], default="single",
                        help="single: decode tok/s of random prompts; copy: speculative decoding on and off")
    parser.add_argument("--speculative-config", default=json.dumps(NGRAM), help="copy: our engines' speculation")
    parser.add_argument("--num-pred-tokens", type=int, default=NGRAM["num_speculative_tokens"],
                        help="copy: llama.cpp's lookup tokens per draft (as our K)")
    parser.add_argument("--max-ngram-size", type=int, default=NGRAM["prompt_lookup_max"],
                        help="copy: llama.cpp's longest n-gram matched (as our prompt_lookup_max)")
    args = parser.parse_args()
    if args.workload == "copy":
        peer_workload.write(args.json, copy_comparison(args))
        return

    from llama_cpp import Llama

    gguf = args.gguf or str(default_model_path())
    batch = args.llama_batch or args.prompt_tokens
    llm = Llama(model_path=gguf, n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=args.prompt_tokens + args.max_tokens + 8, n_batch=batch, n_ubatch=batch, verbose=False)
    dtypes = args.kv_cache_dtypes or ["auto"]
    engines = {f"{a} ({d} KV)" if len(dtypes) > 1 else a: LLMEngine(a, EngineConfig(threads=args.threads,
                                                                                    kv_cache_dtype=d))
               for a in args.artifact for d in dtypes}
    best: dict[str, float] = {}
    for round_ in range(args.rounds):
        rng = np.random.default_rng(round_)
        vocab = next(iter(engines.values())).model.vocab_size
        prompt = rng.integers(FIRST_PLAIN_TOKEN, vocab, args.prompt_tokens).tolist()
        for name, engine in engines.items():
            request = micro.random_requests(vocab, 1, args.prompt_tokens, args.max_tokens, round_)
            tok_s = micro.decode_tok_s(run_engine(engine, request))
            best[name] = max(best.get(name, 0.0), tok_s)
        best["llama.cpp"] = max(best.get("llama.cpp", 0.0), llama_cpp_tok_s(llm, prompt, args.max_tokens))
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()), flush=True)
    results = {"gguf": Path(gguf).name, "threads": args.threads, "prompt_tokens": args.prompt_tokens,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "decode_tok_s": best,
               "precision": {name: engines[name].manifest.precision() for name in engines}}
    peer_workload.write(args.json, results)


if __name__ == "__main__":
    main()
