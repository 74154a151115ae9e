"""The deployment YAML: which artifact to serve and how (KV pool, buckets, scheduler, sampling defaults, server).

Checked in two passes with one error style (field path, value, what is allowed): the schema when the file
loads (types, ranges, unknown keys), then `engine_config` against the artifact's manifest (block size,
exported gears, max_model_len). Relative paths in the file are relative to the file itself. Building a
missing artifact from `model.export_config` is the CLI's job: the runtime never imports the exporter.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Literal, get_args

from pydantic import Field, ValidationInfo, field_validator

from ..artifact.manifest import Manifest
from ..artifact.settings import ConfigError, Settings, load_yaml
from ..graphs.contract import DECODE, PREFILL, Gear
from .engine import EngineConfig
from .executors import CustomOps
from .sampling_params import DEFAULT_MAX_TOKENS, RequestError, SamplingParams
from .spec.config import SpeculativeConfig


class ModelSection(Settings):
    artifact: str = Field(description="exported artifact directory")
    name: str | None = Field(None, description="model id served at /v1/models; default: the artifact's folder name")
    export_config: str | None = Field(None, description="export YAML run by `pagedgraph serve` if no artifact")


class KVCacheSection(Settings):
    block_size: int | None = Field(None, ge=1, description="must equal the artifact's; default: the artifact's")
    num_blocks: int | None = Field(None, ge=2, description="pool size in blocks; wins over kv_cache_bytes")
    kv_cache_bytes: int | None = Field(None, ge=1, description="pool budget in bytes; default (neither set): every "
                                                               "sequence at max_model_len, capped to half the memory "
                                                               "left free after the weights")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes seen before")
    prefix_cache_salt: str = Field("", description="mixed into every block hash: tenants with different salts "
                                                   "never share cached blocks")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "int8"] = Field(
        "auto", description="what the KV pools hold (auto: the artifact's compute dtype); the artifact needs its "
                            "graphs (export.kv_cache_dtypes); pool sizing follows its bytes per block")


class BucketsSection(Settings):
    """Subsets of the exported ladders to serve with (default: all); fewer gears, fewer first-run warmups."""

    decode_batch: list[int] | None = None
    prefill_tokens: list[int] | None = None
    context_blocks: list[int] | None = None

    @field_validator("decode_batch", "prefill_tokens", "context_blocks")
    @classmethod
    def _ascending(cls, ladder: list[int] | None) -> list[int] | None:
        if ladder is not None and (not ladder or ladder != sorted(set(ladder)) or ladder[0] < 1):
            raise ValueError("must be a non-empty, strictly ascending list of positive integers")
        return ladder


class SchedulerSection(Settings):
    max_num_seqs: int = Field(64, ge=1, description="sequences per step (clamped to the largest gear)")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step (clamped to the largest prefill gear)")
    max_model_len: int | None = Field(None, ge=2, description="prompt + output tokens; default: the artifact's")
    long_prefill_token_threshold: int | None = Field(
        None, ge=16, description="cap on one prompt's chunk per step, a multiple of block_size (shorter decode stalls)")
    enable_chunked_prefill: bool = Field(
        True, description="false: each prompt runs whole in one step (needs max_num_batched_tokens >= max_model_len)")
    batch_invariant: bool = Field(
        True, description="greedy output independent of the batch, chunking and prefix hits (no one-token prompt "
                          "chunks; with block-quantized weights no one-row steps); false: faster single-stream decode "
                          "of quantized artifacts (docs/performance.md, 'Batch invariance')")


class SamplingDefaults(Settings):
    """Values used when a request leaves a field out; null: the artifact's generation defaults (the checkpoint's
    generation_config.json, see `pagedgraph inspect`), else SamplingParams' own."""

    max_tokens: int = Field(DEFAULT_MAX_TOKENS, description="capped to what max_model_len leaves after the prompt")
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    @field_validator("max_tokens", "temperature", "top_p", "top_k")
    @classmethod
    def _valid(cls, value: Any, info: ValidationInfo) -> Any:
        """The request rules, so a default is valid exactly when the same value in a request would be."""
        if value is None:
            return value
        try:
            SamplingParams(**{info.field_name: value})
        except RequestError as exc:
            raise ValueError(str(exc).removeprefix(f"{info.field_name}: {value!r} ")) from None
        return value


class ServerSection(Settings):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = Field(None, min_length=1, description="require `Authorization: Bearer <key>` on /v1/*")
    max_concurrent_requests: int = Field(256, ge=1, description="in-flight generations (one per prompt); more "
                                                                "get 429")
    max_prompts_per_request: int = Field(64, ge=1, description="prompts in one /v1/completions body (a list of "
                                                               "them); more get 400")
    request_timeout_s: float = Field(600.0, gt=0, description="a generation running longer is aborted")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413 before they are parsed")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long running requests may finish")
    log_prompts: bool = Field(False, description="log prompt text with each request (off: counts only)")
    request_log: str | None = Field(
        None, description='append one JSON line per finished completion, {"prompt_tokens": N, "completion_tokens": '
                          'M}: the traffic trace `pagedgraph plan --trace` fits the bucket ladders to (no text)')


class ExecutorSection(Settings):
    name: Literal["onnxruntime", "mindspore"] = Field("onnxruntime", description="what runs the bucket graphs")
    threads: int | None = Field(None, ge=1, description="ONNX Runtime intra-op threads (default: all cores)")
    custom_ops: CustomOps = Field("auto", description="ONNX Runtime: run the fused ops as pagedgraph's C++ kernels "
                                                      "(auto: when they build, else warn and fall back; on: or fail; "
                                                      "off: never); mindspore ignores it")

    @field_validator("custom_ops", mode="before")
    @classmethod
    def _yaml_switch(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `on` / `off` as a boolean: take it as the word the user wrote."""
        return ("on" if value else "off") if isinstance(value, bool) else value


RouterPolicy = Literal["cache_aware", "round_robin", "power_of_two", "random", "consistent_hash"]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)


class RouterSection(Settings):
    """vllm-router in front of a fleet's replicas (runtime/fleet/router.py maps these to its flags)."""

    policy: RouterPolicy = Field(
        "cache_aware", description="cache_aware: a prompt goes to the replica whose prefix tree matches it best, "
                                   "unless the replicas' loads drift apart; round_robin; power_of_two; random")
    health_check_interval_s: int = Field(1, ge=1, description="the router checks each replica's /health this often")
    health_failure_threshold: int = Field(1, ge=1, description="failed checks in a row before a replica gets no "
                                                               "more requests")
    health_success_threshold: int = Field(1, ge=1, description="passed checks in a row before it gets them again")
    circuit_open_s: int = Field(2, ge=1, description="after requests to a replica fail, how long the router skips "
                                                     "it before it tries one again")
    max_retries: int = Field(3, ge=1, description="attempts per request across replicas (a request is retried "
                                                  "only before its response has started)")
    cache_threshold: float = Field(0.3, ge=0, le=1, description="cache_aware: the prefix match above which the "
                                                                "best-matching replica is chosen")
    extra_args: list[str] = Field(default_factory=list, description="more vllm-router flags, passed as given")


class FleetSection(Settings):
    """Data parallelism: replicas of this deployment behind a router, all started and stopped by one command."""

    data_parallel_size: int = Field(1, ge=1, description="local replicas started by `pagedgraph serve`")
    cores_per_replica: int | None = Field(None, ge=1, description="CPU cores pinned to each local replica "
                                                                 "(default: the cores available, split evenly)")
    pin_cores: bool = Field(True, description="pin each local replica to its own cores (sched_setaffinity)")
    replica_urls: list[str] = Field(default_factory=list, description="replicas already running elsewhere "
                                                                      "(`pagedgraph serve` URLs), routed to as well")
    restart: bool = Field(True, description="restart a local replica that exits; it rejoins once healthy")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long a replica or the router may take to start")
    metrics_port: int | None = Field(None, ge=0, le=65535, description="every replica's /metrics, labelled by "
                                                                       "replica, on this port (default: server.port "
                                                                       "+ 1; 0: any free port)")
    router: RouterSection = RouterSection()

    @field_validator("replica_urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not a URL: give http://HOST:PORT of a `pagedgraph serve`")
        return [url.rstrip("/") for url in urls]

    @property
    def active(self) -> bool:
        """More than one replica: `pagedgraph serve` runs the fleet instead of one server."""
        return self.data_parallel_size + len(self.replica_urls) > 1


class Deployment(Settings):
    model: ModelSection
    kv_cache: KVCacheSection = KVCacheSection()
    buckets: BucketsSection = BucketsSection()
    scheduler: SchedulerSection = SchedulerSection()
    sampling: SamplingDefaults = SamplingDefaults()
    server: ServerSection = ServerSection()
    executor: ExecutorSection = ExecutorSection()
    fleet: FleetSection = FleetSection()
    speculative_config: SpeculativeConfig | None = Field(
        None, description="speculative decoding with vLLM's keys (method ngram | draft_model, num_speculative_tokens, "
                          "prompt_lookup_min, prompt_lookup_max, model); docs/usage.md")

    @property
    def model_name(self) -> str:
        return self.model.name or Path(self.model.artifact).name


def load_deployment(path: str | Path, overrides: dict[str, Any] | None = None) -> Deployment:
    """Load and validate `path`; dotted-key `overrides` (CLI flags) win, None values are ignored."""
    deployment = load_yaml(Deployment, path, overrides)
    base = Path(path).resolve().parent
    model = deployment.model
    paths = {key: str((base / Path(value).expanduser()).resolve()) for key, value in
             (("artifact", model.artifact), ("export_config", model.export_config)) if value is not None}
    update: dict[str, Any] = {"model": model.model_copy(update=paths)}
    server = deployment.server
    if server.request_log is not None:
        update["server"] = server.model_copy(update={"request_log": str((base / server.request_log).resolve())})
    spec = deployment.speculative_config
    if spec is not None and spec.model is not None:  # the draft's artifact, relative to the file too
        update["speculative_config"] = spec.model_copy(update={"model": str((base / spec.model).resolve())})
    return deployment.model_copy(update=update)


def _exported(manifest: Manifest) -> dict[str, list[int]]:
    """The artifact's ladders, read back from its gears."""
    prefill, decode = manifest.families[PREFILL].gears, manifest.families[DECODE].gears
    return {"decode_batch": sorted({g.seqs for g in decode}), "prefill_tokens": sorted({g.tokens for g in prefill}),
            "context_blocks": sorted({g.blocks for g in prefill + decode})}


def served_gears(manifest: Manifest, decode_batch: Iterable[int], prefill_tokens: Iterable[int],
                 context_blocks: Iterable[int]) -> dict[str, list[Gear]]:
    """The artifact's gears on these rungs (each a subset of its ladders): what a deployment's buckets serve."""
    decode, prefill, blocks = set(decode_batch), set(prefill_tokens), set(context_blocks)
    return {PREFILL: [g for g in manifest.families[PREFILL].gears if g.tokens in prefill and g.blocks in blocks],
            DECODE: [g for g in manifest.families[DECODE].gears if g.seqs in decode and g.blocks in blocks]}


def engine_config(deployment: Deployment, manifest: Manifest, source: str) -> EngineConfig:
    """Check the deployment against the artifact and build the engine's configuration."""
    artifact = deployment.model.artifact
    problems = []
    block_size = deployment.kv_cache.block_size
    if block_size is not None and block_size != manifest.block_size:
        problems.append(f"kv_cache.block_size = {block_size}: the artifact {artifact} was exported with block_size "
                        f"{manifest.block_size}; set {manifest.block_size} (or drop the key), or re-export")
    max_model_len = deployment.scheduler.max_model_len or manifest.max_model_len
    if max_model_len > manifest.max_model_len:
        problems.append(f"scheduler.max_model_len = {max_model_len}: the artifact {artifact} was exported for at most "
                        f"{manifest.max_model_len}; lower it, or re-export with a larger export.max_model_len")
    exported = _exported(manifest)
    chosen = {}
    for name, values in exported.items():
        wanted = getattr(deployment.buckets, name)
        missing = sorted(set(wanted or ()) - set(values))
        if missing:
            problems.append(f"buckets.{name} = {wanted}: {missing} not exported; the artifact {artifact} has "
                            f"{name} {values}: choose a subset, or re-export with them in export.buckets.{name}")
        chosen[name] = set(wanted or values)
    needed = math.ceil(max_model_len / manifest.block_size)
    if max(chosen["context_blocks"]) < needed:
        problems.append(f"buckets.context_blocks = {sorted(chosen['context_blocks'])}: max_model_len {max_model_len} "
                        f"needs {needed} blocks per sequence; add {needed} or lower scheduler.max_model_len")
    kv_dtype = deployment.kv_cache.dtype
    if kv_dtype != "auto" and kv_dtype not in manifest.served_kv_cache_dtypes:
        problems.append(f"kv_cache.dtype = {kv_dtype}: the artifact {artifact} has graphs for the KV-cache dtypes "
                        f"{list(manifest.served_kv_cache_dtypes)}; choose one (or auto), or re-export with {kv_dtype} "
                        f"in export.kv_cache_dtypes")
    if problems:
        raise ConfigError(f"invalid deployment in {source}:\n  " + "\n  ".join(problems))
    gears = served_gears(manifest, chosen["decode_batch"], chosen["prefill_tokens"], chosen["context_blocks"])
    kv, scheduler, executor = deployment.kv_cache, deployment.scheduler, deployment.executor
    return EngineConfig(num_blocks=kv.num_blocks, kv_cache_bytes=kv.kv_cache_bytes, max_num_seqs=scheduler.max_num_seqs,
                        max_num_batched_tokens=scheduler.max_num_batched_tokens, max_model_len=max_model_len,
                        long_prefill_token_threshold=scheduler.long_prefill_token_threshold,
                        enable_chunked_prefill=scheduler.enable_chunked_prefill, gears=gears,
                        batch_invariant=scheduler.batch_invariant,
                        enable_prefix_caching=kv.enable_prefix_caching, prefix_cache_salt=kv.prefix_cache_salt,
                        executor=executor.name, threads=executor.threads, custom_ops=executor.custom_ops,
                        kv_cache_dtype=kv.dtype, speculative_config=deployment.speculative_config)
