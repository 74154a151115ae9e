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
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path
from pagedgraph.runtime.bench import micro
from pagedgraph.runtime.bench.runner import run_engine
from pagedgraph.runtime.bench.workloads import FIRST_PLAIN_TOKEN
from pagedgraph.runtime.engine import EngineConfig, LLMEngine


def llama_cpp_tok_s(llm: Any, prompt: list[int], max_tokens: int) -> float:
    llm.reset()
    times = []
    for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == max_tokens:
            break
    return (len(times) - 1) / (times[-1] - times[0])


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
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from llama_cpp import Llama

    gguf = args.gguf or str(default_model_path())
    llm = Llama(model_path=gguf, n_threads=args.threads, n_threads_batch=args.threads,
                n_ctx=args.prompt_tokens + args.max_tokens + 8, n_batch=args.prompt_tokens, verbose=False)
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
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
