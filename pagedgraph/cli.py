"""`pagedgraph export | generate | serve | atc-plan | bench`: the only module importing both exporter and runtime."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from artifact.settings import ConfigError
from runtime.executors import CUSTOM_OPS


def _export(args: argparse.Namespace) -> int:
    from exporter.config import ExportConfig
    from exporter.export import export
    from artifact.settings import load_yaml

    formats = args.formats.split(",") if args.formats else None
    config = load_yaml(ExportConfig, args.config, {"model.source": args.model, "export.formats": formats,
                                                   "export.target": args.target, "export.baseline": args.baseline})
    export(config, args.out)
    return 0


def _read_requests(path: Path) -> list[dict[str, Any]]:
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise ConfigError(f"{path}:{number}: each line must be a JSON object")
        requests.append(item)
    return requests


def _generate(args: argparse.Namespace) -> int:
    from runtime.engine import LLM
    from runtime.sampling_params import RequestError, SamplingParams

    defaults: dict[str, Any] = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                                  ("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed))
                                if v is not None}
    if args.prompt is not None:
        requests = [{"prompt": args.prompt}]
    elif args.input is not None:
        requests = _read_requests(Path(args.input))
    else:
        raise ConfigError("give --prompt TEXT or --input FILE.jsonl")
    llm = LLM(args.artifact, num_blocks=args.num_blocks, threads=args.threads,
              enable_prefix_caching=not args.no_prefix_caching, executor=args.executor, custom_ops=args.custom_ops)
    prompts, params = [], []
    prompt_keys = ("prompt", "prompt_token_ids", "messages")
    rejected: dict[int, str] = {}
    for i, request in enumerate(requests):
        prompts.append({k: request[k] for k in prompt_keys if k in request})
        try:
            params.append(SamplingParams.from_dict({**defaults, **{k: v for k, v in request.items()
                                                                    if k not in prompt_keys}}))
        except (RequestError, TypeError) as exc:
            rejected[i] = str(exc)
            params.append(SamplingParams(max_tokens=1))
            prompts[-1] = {"prompt_token_ids": []}
    outputs = llm.generate(prompts, params, progress=args.output is not None)
    lines = []
    for i, out in enumerate(outputs):
        record: dict[str, Any] = {"prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids,
                                  "text": out.text, "finish_reason": out.finish_reason}
        if i in rejected or out.error:
            record = {"error": rejected.get(i, out.error), "finish_reason": "error"}
        lines.append(json.dumps(record, ensure_ascii=False))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    elif args.prompt is not None and not outputs[0].error:
        print(args.prompt + outputs[0].text)
    else:
        print("\n".join(lines))
    return 1 if len(rejected) == len(requests) else 0


def _serve(args: argparse.Namespace) -> int:
    import logging

    from exporter.config import ExportConfig
    from exporter.export import export
    from artifact.manifest import MANIFEST
    from artifact.settings import load_yaml
    from runtime.deploy_config import load_deployment
    from runtime.server.launch import serve

    artifact = str(Path(args.artifact).resolve()) if args.artifact else None
    deployment = load_deployment(args.config, {"model.artifact": artifact, "server.host": args.host,
                                               "server.port": args.port, "kv_cache.num_blocks": args.num_blocks,
                                               "server.api_key": args.api_key, "executor.custom_ops": args.custom_ops})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    model = deployment.model
    if not (Path(model.artifact) / MANIFEST).is_file():
        if model.export_config is None:
            raise ConfigError(f"model.artifact {model.artifact} is not an exported artifact; export it with "
                              f"`pagedgraph export`, or set model.export_config so serve builds it")
        logging.getLogger("pagedgraph.server").info("exporting %s with %s", model.artifact, model.export_config)
        export(load_yaml(ExportConfig, model.export_config), model.artifact)
    serve(deployment, args.config)
    return 0


def _atc_plan(args: argparse.Namespace) -> int:
    from exporter.atc import atc_commands

    for family, command in atc_commands(Path(args.artifact), args.num_blocks, args.soc_version).items():
        print(f"# {family}\n{command}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from runtime.bench.report import markdown_table, plot, text_table
    from runtime.bench.suite import NO_BASELINE, BenchOptions, run_bench

    self_compared = args.workload in NO_BASELINE
    baseline = args.baseline or ("none" if self_compared else "naive")
    options = BenchOptions(artifact=args.artifact, workload=args.workload, requests=args.requests, rate=args.rate,
                           seed=args.seed, baseline=None if baseline == "none" else baseline,
                           naive_batch=args.naive_batch, threads=args.threads, executor=args.executor,
                           custom_ops=args.custom_ops, chunk_tokens=args.chunk_tokens,
                           micro=not (args.no_micro or self_compared))
    results = run_bench(options)
    print(text_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown_table(results))
    if args.plot:
        plot(results, Path(args.plot))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pagedgraph.texts import read_text
    from runtime.engine import EngineConfig
    from runtime.perplexity import evaluate_artifacts, ratio_table

    text = read_text(args.text)
    config = EngineConfig(threads=args.threads, executor=args.executor, custom_ops=args.custom_ops)
    results = evaluate_artifacts(args.artifacts, text, args.context, args.stride, config)
    print(ratio_table(results))
    if args.json:
        base = results[0].perplexity
        runs = [{**r.to_dict(), "ratio": r.perplexity / base} for r in results]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"text": args.text, "runs": runs}, indent=2) + "\n")
    return 0


def _custom_ops_flag(parser: argparse.ArgumentParser, default: str | None, what: str) -> None:
    parser.add_argument("--custom-ops", dest="custom_ops", choices=CUSTOM_OPS, default=default,
                        help=f"{what}: run the fused ops as pagedgraph's C++ ONNX Runtime kernels (auto: when "
                             f"they build, else warn and fall back; on: or fail; off: their ONNX function bodies)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="convert a checkpoint into a bucketed graph artifact")
    p.add_argument("--config", required=True, help="export YAML (see configs/smollm2.yaml)")
    p.add_argument("--out", required=True, help="artifact directory to write")
    p.add_argument("--model", help="override model.source: a .gguf file or an HF directory")
    p.add_argument("--format", dest="formats", help="override export.formats: onnx, mindir or onnx,mindir")
    p.add_argument("--target", choices=["cpu", "ascend"], help="override export.target (the MINDIR target)")
    p.add_argument("--baseline", choices=["naive"], help="override export.baseline: also write graphs/naive.onnx")
    p.set_defaults(func=_export)

    p = sub.add_parser("generate", help="generate from an artifact with the paged, packed runtime")
    p.add_argument("--artifact", required=True)
    p.add_argument("--prompt", help="one prompt; prints the completion")
    p.add_argument("--input", help="JSON Lines requests: prompt | prompt_token_ids | messages, plus sampling fields")
    p.add_argument("--output", help="JSON Lines results, in input order (default: stdout)")
    p.add_argument("--max-tokens", type=int, dest="max_tokens", default=64)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float, dest="top_p")
    p.add_argument("--top-k", type=int, dest="top_k")
    p.add_argument("--seed", type=int)
    p.add_argument("--num-blocks", type=int, dest="num_blocks", help="KV pool size in blocks (overrides the budget)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    p.add_argument("--no-prefix-caching", action="store_true", dest="no_prefix_caching",
                   help="never reuse cached KV blocks across requests")
    p.add_argument("--executor", choices=["onnxruntime", "mindspore"], default="onnxruntime",
                   help="run the ONNX graph (onnxruntime) or the CPU MINDIR graphs (mindspore)")
    _custom_ops_flag(p, "auto", "onnxruntime executor")
    p.set_defaults(func=_generate)

    p = sub.add_parser("atc-plan", help="print the ATC commands that compile the artifact's ONNX graph for Ascend")
    p.add_argument("--artifact", required=True)
    p.add_argument("--num-blocks", type=int, dest="num_blocks", default=1024,
                   help="KV pool blocks the OM models are built for (the pools' static size)")
    p.add_argument("--soc-version", dest="soc_version", default="Ascend910B1", help="ATC --soc_version")
    p.set_defaults(func=_atc_plan)

    p = sub.add_parser("serve", help="serve an artifact with an OpenAI-compatible HTTP API")
    p.add_argument("--config", required=True, help="deployment YAML (see configs/deploy-smollm2.yaml)")
    p.add_argument("--artifact", help="override model.artifact")
    p.add_argument("--host", help="override server.host")
    p.add_argument("--port", type=int, help="override server.port (0: any free port)")
    p.add_argument("--num-blocks", type=int, dest="num_blocks", help="override kv_cache.num_blocks")
    p.add_argument("--api-key", dest="api_key", default=os.environ.get("PAGEDGRAPH_API_KEY"),
                   help="override server.api_key (default: $PAGEDGRAPH_API_KEY)")
    _custom_ops_flag(p, None, "override executor.custom_ops")
    p.set_defaults(func=_serve)

    p = sub.add_parser("bench", help="measure the paged engine on a workload against the naive baseline")
    p.add_argument("--artifact", required=True, help="exported with export.baseline: naive for the baseline")
    p.add_argument("--workload", choices=["mixed", "poisson", "shared-prefix", "stress"], default="mixed",
                   help="stress: one 4,000-token prompt arriving while 16 requests decode, chunked prefill on vs "
                        "off (needs a 4,096-token artifact: configs/smollm2-long.yaml)")
    p.add_argument("--requests", type=int, help="number of requests (default: 64; shared-prefix 32; stress 17)")
    p.add_argument("--rate", type=float, default=2.0, help="poisson arrival rate, requests/s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", choices=["naive", "none"],
                   help="run the naive static-batch, contiguous-cache baseline in the same invocation "
                        "(default: naive; none for stress)")
    p.add_argument("--naive-batch", type=int, dest="naive_batch", default=16, help="static batch size of the baseline")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    p.add_argument("--executor", choices=["onnxruntime", "mindspore"], default="onnxruntime",
                   help="the paged engine's executor (mindspore: the artifact's CPU MINDIR graphs)")
    _custom_ops_flag(p, "auto", "the paged engine's onnxruntime executor (the naive baseline never uses them)")
    p.add_argument("--chunk-tokens", type=int, dest="chunk_tokens", default=16,
                   help="stress: the chunked run's long_prefill_token_threshold")
    p.add_argument("--no-micro", action="store_true", dest="no_micro",
                   help="skip decode step time vs context and decode tok/s vs concurrency (always skipped for stress)")
    p.add_argument("--json", help="write the figures as JSON here")
    p.add_argument("--markdown", help="write the table as markdown here")
    p.add_argument("--plot", help="write a PNG plot here (needs matplotlib: pip install -e .[bench])")
    p.set_defaults(func=_bench)

    p = sub.add_parser("eval", help="perplexity of a text file through an artifact's graphs (several: ratio to the first)")
    p.add_argument("--artifact", required=True, action="append", dest="artifacts",
                   help="artifact directory; repeat it to compare, each run's perplexity is shown as a ratio to the "
                        "first (the fp32 baseline)")
    p.add_argument("--text", required=True,
                   help="UTF-8 text file, or a shipped text: heldout (the evaluation text) or calibration")
    p.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--stride", type=int, help="a window starts every STRIDE tokens (default: --context, no overlap)")
    p.add_argument("--json", help="write the figures (perplexity, tokens scored, windows, dtype) as JSON here")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    p.add_argument("--executor", choices=["onnxruntime", "mindspore"], default="onnxruntime")
    _custom_ops_flag(p, "auto", "onnxruntime executor")
    p.set_defaults(func=_eval)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
