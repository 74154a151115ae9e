"""The deployment YAML: which artifact to serve and how (KV pool, buckets, scheduler, sampling defaults, server),
and `EngineConfig`, the engine's view of it.

The schema is the one home of every serving setting's default and meaning: `EngineConfig`'s defaults, the CLI's
flags and docs/server.md's table (`python -m pagedgraph.settings_docs --write`) are read from it.

Checked in two passes with one error style (field path, value, what is allowed): the schema when the file
loads (types, ranges, unknown keys), then `engine_config` against the artifact's manifest (block size,
exported gears, max_model_len). Relative paths in the file are relative to the file itself. Building a
missing artifact from `model.export_config` is the CLI's job: the runtime never imports the exporter.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import reduce
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Sequence as Seq

from pydantic import Field, ValidationInfo, field_validator

from ..artifact.manifest import Manifest
from ..artifact.settings import ConfigError, Settings, default, load_yaml, shown
from ..graphs.contract import DECODE, PREFILL, Gear
from ..graphs.kv_cache import KVCacheDType, cache_format
from .executors import CustomOps, ExecutorName, check_custom_ops
from .sampling_params import DEFAULT_MAX_TOKENS, RequestError, SamplingParams
from .spec.config import SpeculativeConfig, speculative_config

KVCacheSetting = Literal["auto", KVCacheDType]  # "auto": the artifact's compute dtype


class ModelSection(Settings):
    artifact: str = Field(description="exported artifact directory (`pagedgraph export --out`)")
    name: str | None = Field(None, description="model id served by `GET /v1/models`; requests naming another model "
                                               "get 404", json_schema_extra=shown("the artifact's folder name"))
    export_config: str | None = Field(None, description="export YAML that `pagedgraph serve` runs when the artifact "
                                                        "is missing")


class KVCacheSection(Settings):
    block_size: int | None = Field(None, ge=1, description="must equal the artifact's `export.block_size` (a check, "
                                                           "not a setting)", json_schema_extra=shown("the artifact's"))
    num_blocks: int | None = Field(None, ge=2, description="KV pool size in blocks; wins over `kv_cache_bytes`")
    kv_cache_bytes: int | None = Field(
        None, ge=1, json_schema_extra=shown("sized at start"),
        description="KV pool budget in bytes when `num_blocks` is not set; neither set: blocks for every sequence "
                    "(`scheduler.max_num_seqs`, clamped to the gears) at `max_model_len`, capped to half the memory "
                    "left free after the weights (MemAvailable, or the cgroup's limit). A pool that cannot hold one "
                    "`max_model_len` sequence, or an explicit one larger than the free memory, stops the start with "
                    "the figure needed")
    enable_prefix_caching: bool = Field(True, description="reuse the KV blocks of prompt prefixes seen before "
                                                          "(`cached_tokens` in `usage`)")
    prefix_cache_salt: str = Field("", description="mixed into every block hash: tenants with different salts "
                                                   "never share cached blocks")
    dtype: KVCacheSetting = Field(
        "auto", description="what the KV pools hold (`auto`: the artifact's compute dtype); the artifact needs its "
                            "graphs (`export.kv_cache_dtypes`); pool sizing follows its bytes per block")


class BucketsSection(Settings):
    """Subsets of the exported ladders to serve with (default: all); fewer gears, fewer first-run warmups."""

    decode_batch: list[int] | None = Field(None, description="decode gears (batch sizes B) to serve with: a subset "
                                                             "of the exported ones",
                                           json_schema_extra=shown("all exported"))
    prefill_tokens: list[int] | None = Field(None, description="prefill gears (packed tokens T): a subset of the "
                                                               "exported ones",
                                             json_schema_extra=shown("all exported"))
    context_blocks: list[int] | None = Field(None, description="context gears (blocks per sequence M); the largest "
                                                               "must cover `max_model_len`",
                                             json_schema_extra=shown("all exported"))

    @field_validator("decode_batch", "prefill_tokens", "context_blocks")
    @classmethod
    def _ascending(cls, ladder: list[int] | None) -> list[int] | None:
        if ladder is not None and (not ladder or ladder != sorted(set(ladder)) or ladder[0] < 1):
            raise ValueError("must be a non-empty, strictly ascending list of positive integers")
        return ladder


class SchedulerSection(Settings):
    max_num_seqs: int = Field(64, ge=1, description="sequences per step, clamped to the largest gear's B")
    max_num_batched_tokens: int = Field(2048, ge=1, description="tokens per step, clamped to the largest prefill "
                                                                "gear's T")
    max_model_len: int | None = Field(None, ge=2, description="prompt + output tokens per request; at most the "
                                                              "artifact's", json_schema_extra=shown("the artifact's"))
    long_prefill_token_threshold: int | None = Field(
        None, ge=16, json_schema_extra=shown("none (the step budget)"),
        description="cap on one prompt's chunk per step, a multiple of the block size: smaller chunks shorten the "
                    "decode stalls a long prompt causes, at some cost in its TTFT")
    enable_chunked_prefill: bool = Field(
        True, description="false: every prompt runs whole in one step, as in engines without chunked prefill (needs "
                          "`max_num_batched_tokens >= max_model_len`)")
    batch_invariant: bool = Field(
        True, description="greedy output independent of the batch, chunking and prefix hits (no one-token prompt "
                          "chunks; with block-quantized weights no one-row steps); false: faster single-stream decode "
                          "of quantized artifacts (docs/performance.md, \"Batch invariance\")")


class SamplingDefaults(Settings):
    """Values used when a request leaves a field out; null: the artifact's generation defaults (the checkpoint's
    generation_config.json, see `pagedgraph inspect`), else SamplingParams' own."""

    max_tokens: int = Field(
        DEFAULT_MAX_TOKENS, description="used when a request leaves `max_tokens` out, capped to what `max_model_len` "
                                        "leaves after the prompt; a request that asks for more than fits gets 400 "
                                        "(the one policy of `pagedgraph generate`, `LLM` and the server: "
                                        "docs/usage.md, \"Defaults\")")
    temperature: float | None = Field(
        None, json_schema_extra=shown("null: the artifact's"),
        description="used when a request leaves `temperature` out; null: the model's generation default recorded at "
                    "export (its `generation_config.json`; `pagedgraph inspect` shows it), else 1.0")
    top_p: float | None = Field(None, description="likewise for `top_p` (else 1.0)",
                                json_schema_extra=shown("null: the artifact's"))
    top_k: int | None = Field(None, description="likewise for `top_k` (else 0, off)",
                              json_schema_extra=shown("null: the artifact's"))

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
    host: str = Field("127.0.0.1", description="interface to listen on (`0.0.0.0` for all)")
    port: int = Field(8000, ge=0, le=65535, description="port (0: any free port; the log shows which)")
    api_key: str | None = Field(None, min_length=1,
                                description="when set, `/v1/*`, `/tokenize` and `/detokenize` require "
                                            "`Authorization: Bearer <key>` (401 otherwise); `/health`, `/version` "
                                            "and `/metrics` stay open")
    max_concurrent_requests: int = Field(256, ge=1, description="generations in flight (each prompt of a request is "
                                                                "one); more get 429")
    max_prompts_per_request: int = Field(64, ge=1, description="prompts in one `/v1/completions` request (a list of "
                                                               "them); more get 400 naming the setting. 64 covers "
                                                               "lm-evaluation-harness's usual `--batch_size` values")
    request_timeout_s: float = Field(600.0, gt=0, description="a generation running longer is aborted (408, or an "
                                                              "error event when streaming)")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="larger request bodies get 413 before they are parsed")
    drain_timeout_s: float = Field(30.0, ge=0, description="on SIGTERM, how long running requests may finish (new "
                                                           "ones get 503), then the rest end with 503")
    log_prompts: bool = Field(False, description="log prompt text with each request (off: counts only)")
    request_log: str | None = Field(
        None, description='a file (relative to the YAML) that gets one JSON line per finished completion, '
                          '`{"prompt_tokens": N, "completion_tokens": M}` and nothing else: the trace `pagedgraph plan '
                          '--trace` fits the bucket ladders to ([usage.md](usage.md#ladders-fitted-to-traffic-'
                          'pagedgraph-plan))')


class ExecutorSection(Settings):
    name: ExecutorName = Field("onnxruntime", description="what runs the bucket graphs: ONNX Runtime, or MindSpore "
                                                          "on the artifact's CPU MINDIR graphs")
    threads: int | None = Field(None, ge=1, description="ONNX Runtime intra-op threads",
                                json_schema_extra=shown("all cores"))
    custom_ops: CustomOps = Field(
        "auto", description="run the fused ops as pagedgraph's ONNX Runtime custom ops (one C++ kernel each, on ONNX "
                            "Runtime's threads): `auto` when the library builds (it needs ONNX Runtime's C API "
                            "header: `python -m pagedgraph.cpu_kernels.ort_headers` fetches it; the set-up scripts "
                            "do), else one warning and the graphs' standard-op bodies; `on` refuses to start without "
                            "them; `off` never. Same results either way (within float32 summation order); MindSpore "
                            "ignores it (its MINDIR graphs call the kernels themselves)")

    @field_validator("custom_ops", mode="before")
    @classmethod
    def _yaml_switch(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `on` / `off` as a boolean: take it as the word the user wrote."""
        return ("on" if value else "off") if isinstance(value, bool) else value


RouterPolicy = Literal["cache_aware", "round_robin", "power_of_two", "random", "consistent_hash"]


class RouterSection(Settings):
    """vllm-router in front of a fleet's replicas (runtime/fleet/router.py maps these to its flags)."""

    policy: RouterPolicy = Field(
        "cache_aware", description="how the router picks a replica (`--router-policy`; vllm-router's policies): "
                                   "`cache_aware` sends a prompt to the replica whose prefix tree matches it best, "
                                   "unless the replicas' loads drift apart")
    health_check_interval_s: int = Field(1, ge=1, description="the router checks each replica's `/health` this often")
    health_failure_threshold: int = Field(1, ge=1, description="failed checks in a row before a replica leaves the "
                                                               "rotation")
    health_success_threshold: int = Field(1, ge=1, description="passed checks in a row before it rejoins")
    circuit_open_s: int = Field(2, ge=1, description="after requests to a replica fail, how long the router skips "
                                                     "it before it tries one again")
    max_retries: int = Field(3, ge=1, description="attempts per request across replicas, while its response has not "
                                                  "started")
    cache_threshold: float = Field(0.3, ge=0, le=1, description="`cache_aware`: the prefix match above which the "
                                                                "best-matching replica wins")
    extra_args: list[str] = Field(default_factory=list, description="more vllm-router flags, passed as given")


class FleetSection(Settings):
    """Data parallelism: replicas of this deployment behind a router, all started and stopped by one command."""

    data_parallel_size: int = Field(1, ge=1, description="local replicas (`--data-parallel-size`); the fleet runs "
                                                         "when replicas (local + remote) > 1")
    cores_per_replica: int | None = Field(None, ge=1, json_schema_extra=shown("cores available / replicas"),
                                          description="cores pinned to each local replica; too few cores is an "
                                                      "error naming both keys")
    pin_cores: bool = Field(True, description="pin each local replica to its own cores (`sched_setaffinity`); false: "
                                              "replicas share all cores")
    replica_urls: list[str] = Field(default_factory=list,
                                    description="`pagedgraph serve` URLs on other hosts, routed to as well (not "
                                                "started, restarted or drained by this fleet)")
    restart: bool = Field(True, description="restart a local replica that exits; it rejoins once healthy")
    startup_timeout_s: float = Field(300.0, gt=0, description="how long a replica or the router may take to start "
                                                              "(the router waits for every replica, remote ones "
                                                              "included)")
    metrics_port: int | None = Field(None, ge=0, le=65535,
                                     json_schema_extra=shown("`server.port` + 1 (any free port when `server.port` "
                                                             "is 0)"),
                                     description="every replica's `/metrics`, labelled by replica, merged on this "
                                                 "port (0: any free port)")
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
        None, json_schema_extra=shown("none (off)"),
        description="speculative decoding with vLLM's keys (docs/usage.md, \"Speculative decoding\", every key); "
                    "`model`, the draft's artifact, is relative to the YAML; `--speculative-config JSON` on `serve`, "
                    "`generate` and `bench`")

    @property
    def model_name(self) -> str:
        return self.model.name or Path(self.model.artifact).name


def _setting(key: str) -> Any:
    """An EngineConfig field that is the deployment key `key`: its default, like its meaning, is the schema's."""
    return field(default=default(Deployment, key), metadata={"key": key})


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings (`LLM(artifact, **settings)` takes them by these names): each is a deployment key
    (`metadata["key"]`), whose default and meaning the schema above holds (docs/server.md's table is generated from
    it). `gears` is the deployment's `buckets` resolved against the artifact (`engine_config`); None: all of them."""

    num_blocks: int | None = _setting("kv_cache.num_blocks")
    kv_cache_bytes: int | None = _setting("kv_cache.kv_cache_bytes")
    max_num_seqs: int = _setting("scheduler.max_num_seqs")
    max_num_batched_tokens: int = _setting("scheduler.max_num_batched_tokens")
    max_model_len: int | None = _setting("scheduler.max_model_len")
    threads: int | None = _setting("executor.threads")
    gears: Mapping[str, Seq[Gear]] | None = None
    enable_prefix_caching: bool = _setting("kv_cache.enable_prefix_caching")
    prefix_cache_salt: str = _setting("kv_cache.prefix_cache_salt")
    long_prefill_token_threshold: int | None = _setting("scheduler.long_prefill_token_threshold")
    enable_chunked_prefill: bool = _setting("scheduler.enable_chunked_prefill")
    batch_invariant: bool = _setting("scheduler.batch_invariant")
    executor: str = _setting("executor.name")
    custom_ops: CustomOps = _setting("executor.custom_ops")
    kv_cache_dtype: str = _setting("kv_cache.dtype")
    # A SpeculativeConfig, or its keys as a mapping or JSON.
    speculative_config: SpeculativeConfig | Mapping[str, Any] | str | None = _setting("speculative_config")

    def __post_init__(self) -> None:
        check_custom_ops(self.custom_ops)
        object.__setattr__(self, "speculative_config", speculative_config(self.speculative_config))
        if self.kv_cache_dtype != "auto":
            cache_format(self.kv_cache_dtype)  # a clear error for an unknown name


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
    settings = {f.name: reduce(getattr, f.metadata["key"].split("."), deployment) for f in fields(EngineConfig)
                if "key" in f.metadata}
    return EngineConfig(**{**settings, "max_model_len": max_model_len, "gears": gears})
