"""What an export will take on disk and in memory, checked before any work starts: a user converting a 7B model
learns in a second that the disk is too small (with the figure needed), not after ten minutes of writing.

The figures are upper estimates from the tensor shapes and the precision: the artifact's weights at their stored
size (plus a margin for the graphs), the scratch file float32 calibration writes (one slice of layers), and the
peak resident memory: the interpreter and libraries, then the larger of one graph weight being converted and one
slice of layers running in ONNX Runtime (exporter/onnx/slices.py: weights mapped and prepacked, activations).
"""
from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .buckets import plan_gears
from .quantize import BLOCK_SIZES
from .config import ExportConfig
from .onnx.slices import SLICE_BYTES
from ..graphs import models
from ..graphs.config import ModelConfig
from ..graphs.family import GraphWeight, Kind
from ..graphs.kv_cache import cache_format

GiB = 1 << 30
BASELINE = 600 << 20  # Python, numpy, onnx, onnxruntime and tokenizers loaded (docs/performance.md, export memory)
GRAPH_MARGIN = 64 << 20  # per graph file: nodes and function bodies, no weights
# Stored bytes per weight, at most, of each precision's linears (codes + per-block scales, minima, zero points).
# Per block of a block-quantized weight: a float32 scale, a zero point byte (int8 per channel, exporter/quantize.py:
# its row's scale repeated over blocks of up to 256 inputs) and, for w4a16's linears, a float32 minimum at most.
_INT8_BLOCK_BYTES, _W4A16_GROUP_BYTES = 5, 9
_INT8_FORMS = ("w8a16", "w8a8", "w4a16")  # w4a16's embedding and LM head are int8 per channel
# A checkpoint's own blocks (gguf, gptq, awq) as stored here, against their size in the checkpoint file: float32
# scales for float16 ones, zero points unpacked to a byte per block.
_PREQUANTIZED_GROWTH = 1.5


class ExportResourceError(ValueError):
    """The disk or the memory will not hold this export; nothing was written."""


@dataclass(frozen=True)
class Needs:
    artifact: int  # bytes on disk, the artifact
    scratch: int  # bytes on disk, calibration's scratch file (in the temporary directory)
    memory: int  # peak resident bytes


def graph_weight_params(model: ModelConfig, max_positions: int) -> dict[str, int]:
    """Elements of each graph weight (its checkpoint tensors', or the rope tables')."""
    rope = max_positions * model.head_dim
    return {name: sum(math.prod(s.shape) for s in w.sources) if w.role.kind is not Kind.TABLE else rope
            for name, w in models.weight_table(model).items()}


def export_needs(model: ModelConfig, config: ExportConfig, checkpoint_bytes: int) -> Needs:
    """Upper estimates for exporting `model` with `config` from a checkpoint of `checkpoint_bytes` on disk."""
    options, quantization = config.export, config.model.quantization
    params, table = graph_weight_params(model, options.max_model_len), models.weight_table(model)
    stored = {name: _stored_bytes(table[name], n, quantization, config.model.dtype, config.model.group_size)
              for name, n in params.items()}
    if quantization in ("gguf", "gptq", "awq"):
        artifact = int(checkpoint_bytes * _PREQUANTIZED_GROWTH)
    else:
        artifact = sum(stored.values())
    graphs = len(options.kv_cache_dtypes) + (1 if options.baseline else 0)
    if "mindir" in options.formats:  # its own weights file, and the gears' graphs
        artifact += artifact + GRAPH_MARGIN * len(options.kv_cache_dtypes)
    float32 = {name: 4 * n for name, n in params.items()}
    needs_float32 = _calibrates_in_float32(config)
    converting = max(size * (2 if len(table[name].sources) > 1 else 1.5) for name, size in float32.items())
    tokens = max(g.tokens for family in plan_gears(model, options).values() for g in family)
    # a MoE layer holds top_k expanded rows per token: the tokens' copies, their gate/up and their outputs
    moe_width = 0 if model.moe is None else model.moe.top_k * max(2 * model.moe.intermediate_size, model.hidden_size)
    activations = 16 * tokens * max(model.intermediate_size, model.hidden_size, moe_width)
    # a bfloat16 graph's slices hold their linears widened to float32 (OnnxWeights.session_bytes)
    running = 2.5 * _largest_slice(model, float32 if config.model.dtype == "bfloat16" else stored) + activations
    if needs_float32:
        running = max(running, 2.5 * _largest_slice(model, float32) + activations)
    memory = BASELINE + max(converting, running)
    if "mindir" in options.formats:  # the MINDIR writer holds the target's weights at once
        memory += sum(stored.values())
    scratch = _largest_slice(model, float32) if needs_float32 else 0
    return Needs(artifact + GRAPH_MARGIN * graphs, scratch, int(memory))


def _largest_slice(model: ModelConfig, nbytes: Mapping[str, int]) -> int:
    """The most weights one slice of layers holds (exporter/onnx/slices.py: layer_groups' budget, or one layer and
    the embedding or the LM head where that is more)."""
    layer = max(sum(v for k, v in nbytes.items() if k.startswith(f"layers.{i}.")) for i in range(model.num_layers))
    ends = max(nbytes["embed"], nbytes.get("lm_head", 0))
    return min(max(SLICE_BYTES, layer + ends), sum(nbytes.values()))


def _stored_bytes(weight: GraphWeight, params: int, quantization: str, dtype: str, group_size: int) -> int:
    kind = weight.role.kind
    if kind is Kind.LINEAR and quantization == "w4a16":
        return int(params * (0.5 + _W4A16_GROUP_BYTES / group_size))
    if kind.matrix and quantization in _INT8_FORMS:
        inputs = weight.sources[0].shape[-1]
        return int(params * (1 + _INT8_BLOCK_BYTES / max((b for b in BLOCK_SIZES if inputs % b == 0), default=16)))
    if kind.matrix and dtype == "bfloat16":
        return 2 * params
    return 4 * params


def _calibrates_in_float32(config: ExportConfig) -> bool:
    """Whether calibration runs the checkpoint's float32 graph (written slice by slice to scratch) rather than the
    exported one: int8 KV scales of a bfloat16 or MINDIR-only export, Ascend W8A8's static input scales."""
    options = config.export
    int8 = any(cache_format(d).quantized for d in options.kv_cache_dtypes)
    kv_float32 = int8 and (config.model.dtype != "float32" or "onnx" not in options.formats)
    ascend_w8a8 = config.model.quantization == "w8a8" and options.target == "ascend" and "mindir" in options.formats
    return kv_float32 or ascend_w8a8


def checkpoint_bytes(source: Path) -> int:
    """The checkpoint's weights on disk (a GGUF file, or a directory's safetensors files)."""
    if source.is_dir():
        return sum(p.stat().st_size for p in source.glob("*.safetensors"))
    return source.stat().st_size


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """MemAvailable (the kernel's estimate of what can be allocated without swapping), or None where unknown."""
    try:
        with meminfo.open() as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_resources(needs: Needs, out_parent: Path, scratch: Path, memory: int | None = None,
                    free: Mapping[Path, int] | None = None) -> None:
    """Raise ExportResourceError, with the figures, when the disk at `out_parent` (and at `scratch`) or the available
    memory is short of `needs`. `memory` and `free` override what the machine reports (tests)."""
    def free_at(path: Path) -> int:
        return free[path] if free is not None and path in free else shutil.disk_usage(path).free

    parts: dict[Path, dict[str, int]] = {out_parent: {"the artifact": needs.artifact}}
    if needs.scratch:
        where = out_parent if _same_device(out_parent, scratch) else scratch
        parts.setdefault(where, {})["calibration's scratch file"] = needs.scratch
    for path, sizes in parts.items():
        wanted, have = sum(sizes.values()), free_at(path)
        if have < wanted:
            what = " + ".join(f"{name} {_size(size)}" for name, size in sizes.items())
            raise ExportResourceError(
                f"export needs about {_size(wanted)} free at {path} ({what}), and {_size(have)} is free: free some "
                "space, or choose an --out on a larger disk (TMPDIR moves the scratch file)")
    have = available_memory() if memory is None else memory
    if have is not None and have < needs.memory:
        raise ExportResourceError(
            f"export needs about {_size(needs.memory)} of memory at its peak, and {_size(have)} is available "
            "(MemAvailable): stop other programs, or export on a machine with more memory")


def _size(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / (1 << 20):.0f} MiB"


def _same_device(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False
