"""Checkpoint -> artifact directory: graphs, weights once, tokenizer, manifest (written atomically)."""
from __future__ import annotations

import functools
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence, TextIO

import numpy as np
import onnx
from onnx import numpy_helper
from tqdm import tqdm

from ..artifact.manifest import (MANIFEST, Family, Manifest, RankLayout, contents, file_sha256, fresh_sibling,
                                 kv_variant, rank_file, rank_folder)
from ..artifact.mindir import INDEX as MINDIR_INDEX
from ..artifact.mindir import WEIGHTS as MINDIR_WEIGHTS
from ..cpu_kernels.int8_gemm import SHIFTED_FILE, forget_shifted
from .buckets import plan_gears
from .checkpoint import read_checkpoint
from .checkpoint.base import Checkpoint
from .config import (MINDIR_CONTEXT_STEPS, MINDIR_DECODE_BATCHES, MINDIR_PREFILL_TOKENS,
                             ExportConfig, ExportOptions)
from .kv_calibration import calibrate_kv_scales, calibration_windows, linear_input_ranges, static_input_params
from .onnx.contiguous import naive_model
from .onnx.graph_builder import OnnxBuilder
from .onnx.slices import Slice, artifact_slices, carry, checkpoint_slices, graph_sources, layer_groups, slice_feed, \
    slice_weights
from .onnx.weights_file import StreamedWeights, WeightsFile
from .progress import stage_bar
from .quantize import quantize_weights
from .resources import available_memory, check_resources, checkpoint_bytes, export_needs, graph_weight_params
from .smoothquant import smooth
from .tensor_parallel import ShardedWeights
from .tokenizer_files import write_tokenizer
from ..graphs import contract as c
from ..graphs import models
from ..graphs.config import ModelConfig
from ..graphs.contract import Gear
from ..graphs.family import GraphOptions, Kind
from ..graphs.kv_cache import CacheFormat, cache_format
from ..graphs.quant import DenseForm, Weight
from ..graphs.tensor_parallel import RankShard, check_size, rank_config, shards
from ..graphs.weight_forms import WeightForms

GRAPH = "graphs/model.onnx"
WEIGHTS = "graphs/weights.bin"  # next to the graph: ONNX external data must stay inside the graph's folder
NAIVE_GRAPH = "graphs/naive.onnx"  # export.baseline: naive; reads WEIGHTS, stores none of its own


class ExportTargetError(ValueError):
    """An --out that export must not write to; nothing was changed."""


@dataclass(frozen=True)
class GearReport:
    family: str
    gear: Gear
    seconds: float


@dataclass(frozen=True)
class OnnxWeights:
    """What writing GRAPH left: each weight's initializer (a reference into WEIGHTS), each graph weight's form and
    stored bytes. The KV-cache variants, the baseline and the slices of calibration and checks reuse them."""

    initializers: dict[str, onnx.TensorProto]
    forms: WeightForms
    nbytes: dict[str, int]

    def session_bytes(self, name: str) -> int:
        """What graph weight `name` takes in an ONNX Runtime session without the custom ops (the slices of
        calibration and checks): its stored bytes, twice for bfloat16, which the portable Linear.bfloat16 body
        widens to float32 once at session creation (constant folding)."""
        form = self.forms.forms.get(name)
        widened = isinstance(form, DenseForm) and form.dtype == "bfloat16"
        return self.nbytes.get(name, 0) * (2 if widened else 1)


def export(config: ExportConfig, out_dir: str | Path, log: TextIO | None = None, force: bool = False,
           verbose: bool = False, calibration_text: str | None = None) -> Manifest:
    """Export `config` to `out_dir`; an interrupted export leaves no half artifact behind.

    `out_dir` must be a new path, an empty directory or an artifact (see `check_out_dir`).
    `calibration_text`: what int8 KV-cache scales are fitted on when export.kv_cache_calibration names no file.

    The checkpoint is read one tensor at a time as the graph first needs it (converted, written to the weights file,
    dropped), and calibration and the gear check run large models a slice of layers at a time, so memory stays at a
    few tensors and one slice whatever the model's size; disk and memory are checked before any work starts.
    """
    log = log or sys.stderr
    out_dir = Path(out_dir)
    check_out_dir(out_dir, config.model.source, force)
    started = time.perf_counter()
    print(f"reading checkpoint {config.model.source} ...", file=log)
    raw = read_checkpoint(config.model.source, keep_blocks=config.model.quantization == "gguf")
    own = config.for_checkpoint(raw.quantization)
    if own is not config:
        print(f"model.quantization: {raw.quantization} (the checkpoint's own blocks, read as they are)", file=log)
        config = own
    recorded = RecordedForms(_quantized(raw, config, log).tensors)
    checkpoint = dataclasses.replace(raw, tensors=recorded)  # generation defaults and the rest kept
    model = checkpoint.config
    config = _implied_defaults(config, model, log)
    options = config.export
    check_size(model, options.tensor_parallel_size)
    gears = plan_gears(model, options)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    needs = export_needs(model, config, checkpoint_bytes(Path(raw.source)))
    check_resources(needs, out_dir.parent, Path(tempfile.gettempdir()))
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    staging.chmod(0o777 & ~_umask())  # mkdtemp makes it owner-only; an artifact is meant to be shared
    try:
        print(f"lowering {model.architecture}: {model.num_layers} layers, hidden {model.hidden_size}, "
              f"{model.num_heads}/{model.num_kv_heads} heads, vocab {model.vocab_size}", file=log)
        written = None
        ranks = shards(model, options.tensor_parallel_size) if options.tensor_parallel_size > 1 else ()
        if "onnx" in options.formats:
            for shard in ranks or (None,):
                onnx_weights = _write_onnx(checkpoint, options.max_model_len, options.block_size,
                                           options.accuracy_level, config.model.dtype, staging, log, shard)
            # the rank graphs run only together (AllReduce): no calibration slices, variants or gear check over one
            written = None if ranks else onnx_weights
            if ranks and options.verify_gears:
                print(f"gears not verified: the {len(ranks)} rank graphs run only together (their AllReduce); "
                      "`pagedgraph generate` runs them (the single-process simulation)", file=log)
        with tempfile.TemporaryDirectory(prefix="pagedgraph-calibration-") as scratch:
            calibration = CalibrationSource(raw, options, calibration_text, Path(scratch))
            kv_scales = _kv_scales(model, config, gears, staging, written, calibration, log)
            mindir_checkpoint, w8a8_inputs = _w8a8_static(raw, checkpoint, config, gears, calibration, log)
        del raw, calibration
        if written is not None:
            _write_kv_variants(model, config, written, staging, kv_scales)
        if "mindir" in options.formats:
            from .mindspore.export import write_mindir

            for shard in ranks or (None,):
                write_mindir(dataclasses.replace(mindir_checkpoint,
                                                 tensors=recorded.also(mindir_checkpoint.tensors)),
                             gears, options.max_model_len, options.block_size, options.target, staging, log,
                             options.mindir_workers, config.model.dtype, tuple(options.kv_cache_dtypes), kv_scales,
                             w8a8_inputs, shard)
        if options.baseline == "naive":
            for kv_cache_dtype in options.kv_cache_dtypes:
                _write_naive(model, options.block_size, staging, kv_cache_dtype, config.model.dtype)
        write_tokenizer(checkpoint.tokenizer, staging)
        (staging / "export_config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2))
        _drop_shifted(staging)  # the calibration's, on a CPU whose int8 GEMM is rewritten (cpu_kernels/int8_gemm.py)
        files = _checksums(staging, log)
        manifest = Manifest(
            model=model, block_size=options.block_size, max_model_len=options.max_model_len, dtype=config.model.dtype,
            quantization=config.model.quantization, weight_formats=recorded.counts(),
            families={name: Family(GRAPH if "onnx" in options.formats else MINDIR_INDEX, family_gears)
                      for name, family_gears in gears.items()},
            files=files, export_config=config.model_dump(mode="json"),
            generation_defaults={name: {"value": value, "source": checkpoint.generation_source}
                                 for name, value in checkpoint.generation_defaults.items()},
            exported_with=_versions(), kv_cache_dtypes=tuple(options.kv_cache_dtypes),
            tensor_parallel_size=options.tensor_parallel_size,
            ranks=tuple(RankLayout(s.rank, rank_folder(GRAPH, s.rank), s.heads, s.kv_heads, s.intermediate)
                        for s in ranks))
        (staging / MANIFEST).write_text(manifest.to_json())
        reports = _verify_gears(staging, manifest, written, kv_scales, log) \
            if options.verify_gears and written is not None else []
        _drop_shifted(staging)
        _move_into_place(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _summary(out_dir, manifest, reports, time.perf_counter() - started, log, verbose)
    return manifest


class RecordedForms(Mapping[str, Weight]):
    """Checkpoint tensors, each form noted as it is read: the manifest's weight_formats, without a second pass."""

    def __init__(self, tensors: Mapping[str, Weight]) -> None:
        self._tensors = tensors
        self._forms: dict[str, str] = {}

    def __getitem__(self, name: str) -> Weight:
        w = self._tensors[name]
        self._forms[name] = _form_name(w)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def also(self, tensors: Mapping[str, Weight]) -> "RecordedForms":
        """Other tensors of the same names (the MINDIR's smoothed ones), noted here as they are read."""
        view = RecordedForms(tensors)
        view._forms = self._forms
        return view

    def counts(self) -> dict[str, int]:
        """How many checkpoint tensors are held in each form ("float32", "Q4_1", "rtn-int8-per-channel", ...); a
        tensor the export never read is read now."""
        for name in self._tensors:
            if name not in self._forms:
                self[name]
        found: dict[str, int] = {}
        for form in self._forms.values():
            found[form] = found.get(form, 0) + 1
        return dict(sorted(found.items()))


def _form_name(w: Weight) -> str:
    return "float32" if isinstance(w, np.ndarray) else w.source


def _implied_defaults(config: ExportConfig, model: ModelConfig, log: TextIO) -> ExportConfig:
    """Defaults that depend on the model or the formats, for keys the YAML leaves out (recorded in the
    artifact's export config as used): max_model_len at most the model's max_position_embeddings (as vLLM
    derives it), and with MINDIR and no export.buckets the short ATC-style ladders of exporter.config."""
    options, update = config.export, {}
    if "max_model_len" not in options.model_fields_set and model.max_position_embeddings < options.max_model_len:
        update["max_model_len"] = model.max_position_embeddings
        print(f"export.max_model_len: {model.max_position_embeddings} (the model's max_position_embeddings)", file=log)
    if "mindir" in options.formats and "buckets" not in options.model_fields_set:
        needed = math.ceil(update.get("max_model_len", options.max_model_len) / options.block_size)
        short = {"decode_batch": list(MINDIR_DECODE_BATCHES), "prefill_tokens": list(MINDIR_PREFILL_TOKENS),
                 "context_blocks": sorted({max(1, needed // 4 ** i) for i in range(MINDIR_CONTEXT_STEPS)})}
        print("MINDIR ladders (3-4 gears per dimension, as ATC recommends; set export.buckets to choose): "
              + "; ".join(f"{name} {ladder}" for name, ladder in short.items()), file=log)
        update["buckets"] = options.buckets.model_copy(update=short)
    if not update:
        return config
    return config.model_copy(update={"export": options.model_copy(update=update)})


def check_out_dir(out_dir: Path, source: str, force: bool = False) -> None:
    """Export writes only to a new path, an empty directory or an artifact: never over anything else, so a
    checkpoint, a config folder or a user's notes can never be lost. Replacing an artifact exported from
    another checkpoint needs `force`; re-exporting the same one does not."""
    if not out_dir.exists():
        return
    elsewhere = f"choose a new directory, e.g. `--out {shlex.quote(str(fresh_sibling(out_dir)))}`"
    if not out_dir.is_dir():
        raise ExportTargetError(f"--out {out_dir} is a file, not a directory; nothing was changed; {elsewhere}")
    if (out_dir / MANIFEST).is_file():
        previous = _exported_from(out_dir)
        if previous is not None and not _same_source(previous, source) and not force:
            raise ExportTargetError(f"--out {out_dir} holds an artifact exported from {previous}, not from {source}; "
                                    f"nothing was changed; add --force to replace it, or {elsewhere}")
        return
    held = contents(out_dir)
    if held:
        raise ExportTargetError(f"--out {out_dir} is not empty and not a pagedgraph artifact (it holds {held}); "
                                f"export never writes over other files, with or without --force, and nothing was "
                                f"changed; {elsewhere}")


def _exported_from(artifact: Path) -> str | None:
    """The model.source an artifact was exported from (None when its manifest does not say)."""
    try:
        source = json.loads((artifact / MANIFEST).read_text())["export_config"]["model"]["source"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return source if isinstance(source, str) else None


def _same_source(a: str, b: str) -> bool:
    def canonical(source: str) -> str:
        return source if source == "default" else str(Path(source).expanduser().resolve())

    return canonical(a) == canonical(b)


def _move_into_place(staging: Path, out_dir: Path) -> None:
    """Rename `staging` to `out_dir`; an artifact already there is renamed aside first and deleted last.

    So a crash at any point leaves `out_dir` holding the old artifact or the new one, whole (or, between
    the two renames, nothing; the old one then lies in a hidden `.<name>.old-*` sibling).
    """
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    out_dir.rename(aside / out_dir.name)
    staging.rename(out_dir)
    shutil.rmtree(aside)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _quantized(checkpoint: Checkpoint, config: ExportConfig, log: TextIO) -> Checkpoint:
    """The checkpoint with its linears quantized round-to-nearest (as each is read) where `model.quantization` asks."""
    if config.model.quantization not in ("w8a16", "w4a16", "w8a8"):
        return checkpoint
    print(f"quantizing weights {config.model.quantization} (round to nearest"
          f"{f', groups of {config.model.group_size}' if config.model.quantization == 'w4a16' else ''}) ...", file=log)
    tensors = quantize_weights(checkpoint.config, checkpoint.tensors, config.model.quantization,
                               config.model.group_size)
    return dataclasses.replace(checkpoint, tensors=tensors)  # generation defaults and the rest kept


def _write_onnx(checkpoint: Checkpoint, max_positions: int, block_size: int, accuracy_level: int, dtype: str,
                out: Path, log: TextIO, shard: RankShard | None = None) -> OnnxWeights:
    """GRAPH (its KV cache in the compute dtype, kv_cache.dtype auto) and WEIGHTS, one graph weight at a time: the
    model definition's first read of a weight converts it from the checkpoint and appends it to WEIGHTS.

    With a tensor-parallel `shard`, rank shard.rank's graph and weights, in its folder (graphs/rank<r>/)."""
    model = checkpoint.config
    params = graph_weight_params(model, max_positions)
    size = 1 if shard is None else shard.size
    graph_path, weights_path = ((GRAPH, WEIGHTS) if shard is None else
                                (rank_file(p, rank_folder(GRAPH, shard.rank)) for p in (GRAPH, WEIGHTS)))
    (out / graph_path).parent.mkdir(parents=True)
    graph_weights: Mapping[str, Weight] = models.graph_weights(model, checkpoint.tensors, max_positions, dtype)
    if shard is not None:
        graph_weights = ShardedWeights(graph_weights, model, shard)
    desc = "converting weights" + ("" if shard is None else f" (rank {shard.rank} of {size})")
    with WeightsFile(out / weights_path) as weights, stage_bar(log, sum(params.values()), desc, "") as bar:
        store = StreamedWeights(graph_sources(model), graph_weights.__getitem__, weights,
                                lambda name: bar.update(params[name]))
        builder = OnnxBuilder(rank_config(model, size), store.initializer, dtype)  # pools of the compute dtype
        models.build(builder, model, GraphOptions(block_size, WeightForms(store.forms, accuracy_level), dtype,
                                                  tensor_parallel_size=size))
        graph = builder.model("pagedgraph")
    onnx.save_model(graph, out / graph_path)
    onnx.checker.check_model(out / graph_path, full_check=True)
    return OnnxWeights(store.written, WeightForms(store.known_forms(), accuracy_level), store.nbytes)


class CalibrationSource:
    """What both calibrations (int8 KV-cache scales, Ascend W8A8 input scales) run over: the calibration text's
    token ids (tokenized once) cut into windows, and the float32 graph of the checkpoint as read (before RTN
    quantization), in slices whose weights are written to `scratch` as each is reached."""

    def __init__(self, raw: Checkpoint, options: ExportOptions, default_text: str | None, scratch: Path) -> None:
        self._raw, self._options, self._default_text, self._scratch = raw, options, default_text, scratch

    @functools.cached_property
    def tokens(self) -> tuple[list[int], str]:
        """The token ids and where the text came from."""
        return _calibration_tokens(self._raw, self._options.kv_cache_calibration, self._default_text)

    def windows(self, gears: Sequence[Gear]) -> list[Sequence[int]]:
        """The windows prefilled on the prefill `gears`: as many as the model's size allows (kv_calibration's
        CALIBRATION_BUDGET)."""
        options = self._options
        params = sum(graph_weight_params(self._raw.config, options.max_model_len).values())
        return calibration_windows(self.tokens[0], options.kv_cache_calibration_window, gears, options.block_size,
                                   params)

    def describe(self, windows: Sequence[Sequence[int]]) -> str:
        """`on TEXT: N tokens in W windows` (with `of ALL` where the model's size kept only some)."""
        tokens, source = self.tokens
        used = sum(len(w) for w in windows)
        whole = "" if used == len(tokens) else f" of {len(tokens)}"
        bound = "" if used == len(tokens) else " (bounded by the model's size: kv_calibration.CALIBRATION_BUDGET)"
        return f"on {source}: {used}{whole} tokens in {len(windows)} window{'s' * (len(windows) != 1)}{bound}"

    @functools.cached_property
    def groups(self) -> list[tuple[int, ...]]:
        params = graph_weight_params(self._raw.config, self._options.max_model_len)
        return layer_groups(self._raw.config, lambda name: 4 * params[name])

    def float32_slices(self) -> Iterator[Slice]:
        options = self._options
        return checkpoint_slices(self._raw.config, self._raw.tensors, options.max_model_len, options.block_size,
                                 options.accuracy_level, self._scratch, self.groups)


def _calibration_bar(log: TextIO, groups: list[tuple[int, ...]], windows: Sequence[Sequence[int]], what: str) -> tqdm:
    layered = sum(1 for layers in groups if layers)  # the LM head alone is not run
    return stage_bar(log, layered * len(windows), f"calibrating {what}" + (
        f" ({layered} slices of layers)" if layered > 1 else ""), "window")


def _kv_scales(model: ModelConfig, config: ExportConfig, gears: dict[str, tuple[Gear, ...]], staging: Path,
               written: OnnxWeights | None, calibration: CalibrationSource, log: TextIO) -> dict[str, np.ndarray]:
    """The int8 KV-cache parameters, calibrated once on the exported ONNX graph (the calibration's float32 graph
    when the export writes no ONNX, or one whose pools are not float32: model.dtype bfloat16) and shared by the
    ONNX and MINDIR int8 graphs; {} without int8."""
    options = config.export
    if not any(cache_format(d).quantized for d in options.kv_cache_dtypes):
        return {}
    windows = calibration.windows(gears[c.PREFILL])
    if written is not None and config.model.dtype == "float32":
        groups = layer_groups(model, written.session_bytes)
        slices = artifact_slices(staging / GRAPH, model, options.block_size, written.forms, "float32",
                                 written.initializers, groups)
    else:
        groups, slices = calibration.groups, calibration.float32_slices()
    with _calibration_bar(log, groups, windows, "int8 KV-cache scales") as bar:
        scales = calibrate_kv_scales(slices, model, gears[c.PREFILL], options.block_size, windows, bar.update)
    print(f"calibrated int8 KV-cache scales {calibration.describe(windows)}", file=log)
    return scales


def _w8a8_static(raw: Checkpoint, checkpoint: Checkpoint, config: ExportConfig, gears: dict[str, tuple[Gear, ...]],
                 calibration: CalibrationSource, log: TextIO) -> tuple[Checkpoint, dict[str, tuple[float, int]]]:
    """Ascend W8A8 (MindIE's static form): the checkpoint the MINDIR quantizes (norm-fed linears smoothed,
    exporter/smoothquant.py) and each int8 linear's per-tensor input (scale, offset), calibrated on the float32
    graph of the unquantized checkpoint (slice by slice) over the calibration text; every other export:
    `checkpoint` as it is and {}."""
    options = config.export
    if config.model.quantization != "w8a8" or options.target != "ascend" or "mindir" not in options.formats:
        return checkpoint, {}
    linears = [name for name, w in models.weight_table(raw.config).items()
               if w.role.kind is Kind.LINEAR and w.role.int8_activations]
    windows = calibration.windows(gears[c.PREFILL])
    with _calibration_bar(log, calibration.groups, windows, "W8A8 input scales") as bar:
        ranges = linear_input_ranges(calibration.float32_slices(), raw.config, gears[c.PREFILL], options.block_size,
                                     windows, linears, bar.update)
    print(f"calibrated W8A8 static input scales of {len(ranges)} linears {calibration.describe(windows)}; "
          f"SmoothQuant alpha {options.w8a8_smoothing}", file=log)
    if options.w8a8_smoothing is not None:  # the smoothed weights are quantized again; unsmoothed, `checkpoint` is
        smoothed, ranges = smooth(raw.config, raw.tensors, ranges, options.w8a8_smoothing)
        checkpoint = _quantized(dataclasses.replace(raw, tensors=smoothed), config, log)
    return checkpoint, {name: static_input_params(*ranges[name]) for name in linears}


def _scale_initializers(scales: dict[str, np.ndarray]) -> dict[str, onnx.TensorProto]:
    """An int8 cache's calibrated per-channel parameters: small inline initializers of its own graphs."""
    return {name: numpy_helper.from_array(array, name) for name, array in scales.items()}


def _write_kv_variants(model: ModelConfig, config: ExportConfig, written: OnnxWeights, out: Path,
                       scales: dict[str, np.ndarray]) -> None:
    """One graph per extra KV-cache dtype, beside GRAPH and reading its weights file (kv_variant names them).

    int8 graphs carry their calibrated per-channel `scales` as small inline parameters of their own."""
    options = config.export
    for kv_cache_dtype in [d for d in options.kv_cache_dtypes if d != config.model.dtype]:
        own = _scale_initializers(scales) if cache_format(kv_cache_dtype).quantized else {}
        builder = OnnxBuilder(model, {**written.initializers, **own}.__getitem__, kv_cache_dtype)
        models.build(builder, model, GraphOptions(options.block_size, written.forms, kv_cache_dtype))
        path = out / kv_variant(GRAPH, kv_cache_dtype, config.model.dtype)
        onnx.save_model(builder.model("pagedgraph"), path)
        onnx.checker.check_model(path, full_check=True)


def _drop_shifted(staging: Path) -> None:
    """The shifted int8 weights the export's own runs wrote beside the staged weights: not part of the artifact."""
    for shifted in staging.rglob(SHIFTED_FILE):
        forget_shifted(shifted.parent)


def _checksums(staging: Path, log: TextIO) -> dict[str, str]:
    """Every file's sha256 (the manifest's), with a progress bar over the bytes read."""
    paths = [p for p in sorted(staging.rglob("*")) if p.is_file()]
    with stage_bar(log, sum(p.stat().st_size for p in paths), "checksums", "B") as bar:
        files = {}
        for path in paths:
            files[str(path.relative_to(staging))] = file_sha256(path)
            bar.update(path.stat().st_size)
    return files


def _calibration_tokens(checkpoint: Checkpoint, text_file: str | None, default_text: str | None
                        ) -> tuple[list[int], str]:
    """The calibration text's token ids (the model's own tokenizer) and where the text came from:
    export.kv_cache_calibration's file, else `default_text` (the CLI passes the shipped text)."""
    from tokenizers import Tokenizer

    if text_file is not None:
        if not Path(text_file).is_file():
            raise FileNotFoundError(f"export.kv_cache_calibration = {text_file!r}: no such text file; give the text "
                                    f"the int8 KV-cache scales are calibrated on, or drop the key for the shipped one")
        text, source = Path(text_file).read_text(), text_file
    elif default_text is not None:
        text, source = default_text, "the default calibration text"
    else:
        raise ValueError("an int8 KV cache needs a calibration text: set export.kv_cache_calibration to a text file "
                         "(`pagedgraph export` passes the shipped one by default)")
    tokenizer = Tokenizer.from_str(checkpoint.tokenizer.tokenizer_json)
    return tokenizer.encode(text, add_special_tokens=False).ids, source


def _write_naive(model: ModelConfig, block_size: int, out: Path, kv_cache_dtype: str, compute_dtype: str) -> None:
    paged = onnx.load_model(out / kv_variant(GRAPH, kv_cache_dtype, compute_dtype), load_external_data=False)
    path = out / kv_variant(NAIVE_GRAPH, kv_cache_dtype, compute_dtype)
    onnx.save_model(naive_model(model, paged, block_size, kv_cache_dtype), path)
    onnx.checker.check_model(path, full_check=True)


def _verify_gears(artifact: Path, manifest: Manifest, written: OnnxWeights, kv_scales: dict[str, np.ndarray],
                  log: TextIO, clock: Callable[[], float] = time.perf_counter) -> list[GearReport]:
    """Run the smallest and largest gear of each family once on a tiny pool (each other KV-cache dtype's graph: its
    smallest gears), over the weights file as written (memory-mapped, never in a model proto).

    Every gear shares one symbolic graph, so its ends prove the shapes the runtime feeds load and run. A model
    larger than one slice of layers (exporter/onnx/slices.py) runs slice by slice: the smallest gears through
    every layer, the largest through the first and last slices (the layers between run the same shapes). Where
    even one slice does not fit the available memory, nothing runs and the export says so."""
    model = manifest.model
    groups = layer_groups(model, written.session_bytes)
    largest = max(sum(written.session_bytes(n) for n in slice_weights(model, layers, index + 1 == len(groups)))
                  for index, layers in enumerate(groups))
    have = available_memory()
    if have is not None and 2.5 * largest > have:
        print(f"did not verify the gears: running the largest slice of layers maps and prepacks about "
              f"{2.5 * largest / 2**30:.1f} GiB, and {have / 2**30:.1f} GiB is available; the artifact is complete "
              "(check it with `pagedgraph generate` where it fits)", file=log)
        return []
    if len(groups) > 1:
        mapped = sum(written.nbytes.values()) / 2**30
        print(f"verifying in {len(groups)} slices of layers (the whole graph maps {mapped:.1f} GiB): the smallest "
              "gears through every layer, the largest through the first and last slices", file=log)
    max_blocks = max(g.blocks for f in manifest.families.values() for g in f.gears)
    reports = []
    total = sum(len(manifest.families) * (2 if d == manifest.dtype else 1) for d in manifest.served_kv_cache_dtypes)
    bar = stage_bar(log, len(groups) * len(manifest.served_kv_cache_dtypes), "verifying gears", "slice")
    for dtype in manifest.served_kv_cache_dtypes:
        smallest = {family: min(spec.gears) for family, spec in manifest.families.items()}
        checks = [(family, gear) for family, spec in manifest.families.items()
                  for gear in sorted({min(spec.gears), max(spec.gears)} if dtype == manifest.dtype
                                     else {min(spec.gears)})]
        own = _scale_initializers(kv_scales) if cache_format(dtype).quantized else {}
        slices = artifact_slices(artifact / kv_variant(GRAPH, dtype, manifest.dtype), model, manifest.block_size,
                                 written.forms, dtype, {**written.initializers, **own}, groups)
        fmt = cache_format(dtype)
        pool = np.zeros(((max_blocks + 1) * manifest.block_size, model.kv_size), fmt.numpy_dtype)
        carried: dict[tuple[str, Gear], dict[str, np.ndarray]] = {check: {} for check in checks}
        seconds = dict.fromkeys(checks, 0.0)
        logits = {check: np.zeros((check[1].seqs, model.vocab_size), np.float32) for check in checks}
        for index, part in enumerate(slices):
            session = part.session()
            for family, gear in checks:
                if gear != smallest[family] and 0 < index < len(groups) - 1:
                    continue
                run = _verify_binding(session, part, model, gear, pool, fmt, carried[family, gear],
                                      logits[family, gear])
                start = clock()
                session.run_with_iobinding(run.binding)
                seconds[family, gear] += clock() - start
                carried[family, gear] = carry(run.handed_on)
            del session
            bar.update()
        for family, gear in checks:
            reports.append(GearReport(family, gear, seconds[family, gear]))
            if not np.isfinite(logits[family, gear][0]).all():
                raise RuntimeError(f"{family} gear {gear} ({dtype} KV cache) produced bad logits")
            print(f"[verify {len(reports)}/{total}] {family} T={gear.tokens} B={gear.seqs} M={gear.blocks} "
                  f"{dtype} KV ok ({reports[-1].seconds * 1e3:.0f} ms)", file=log)
    bar.close()
    return reports


@dataclass(frozen=True)
class _VerifyRun:
    binding: Any
    handed_on: list[np.ndarray]  # the residual stream the slice writes (filled by the run)


def _verify_binding(session: Any, part: Slice, model: ModelConfig, gear: Gear, pool: np.ndarray, fmt: CacheFormat,
                    carried: dict[str, np.ndarray], logits: np.ndarray) -> _VerifyRun:
    """One slice's run of `gear`: one real query token, the rest padding; every pool the same zero buffer (written
    only in the null block), bound as input and output."""
    import onnxruntime as ort

    binding = session.io_binding()
    for i in part.layers:
        for name in (c.k_cache_name(i), c.v_cache_name(i)):
            value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(pool.view(f"u{fmt.itemsize}"), fmt.onnx_type)
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(c.cache_output_name(name), value)
    feed = {name: np.zeros(shape, c.INPUT_DTYPES[name]) for name, shape in gear.input_shapes().items()}
    feed[c.CU_SEQLENS_Q][1:] = 1
    feed[c.CONTEXT_LENS][0] = 1
    for name, array in slice_feed(session, feed, carried).items():
        binding.bind_cpu_input(name, array)
    handed_on = [np.zeros((gear.tokens, model.hidden_size), np.float32) for _ in part.carried]
    for name, array in zip(part.carried, handed_on):
        binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))
    if not handed_on:
        binding.bind_ortvalue_output(c.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
    return _VerifyRun(binding, handed_on)


def _summary(out: Path, manifest: Manifest, reports: list[GearReport], seconds: float, log: TextIO,
             verbose: bool) -> None:
    """A few lines per bucket family; with `verbose`, one row per gear (the full table is the manifest's)."""
    size = {rel: (out / rel).stat().st_size for rel in manifest.files}
    print("", file=log)
    first = 0 if manifest.ranks else None  # with tensor parallelism, rank 0's graph stands for each rank's
    for family, spec in manifest.families.items():
        graph = manifest.graph_for(family, manifest.dtype, first)
        print(f"{family_summary(family, spec.gears)}; graph {graph} {size[graph] / 1e6:.2f} MB", file=log)
    if verbose:
        timed: dict[tuple[str, Gear], float] = {}
        for r in reports:  # the compute dtype's graph first: its times are the ones shown
            timed.setdefault((r.family, r.gear), r.seconds)
        print(f"\n{'bucket':30} {'input_ids':>10} {'block_tables':>13} {'verify':>8}", file=log)
        for family, spec in manifest.families.items():
            for g in spec.gears:
                run = timed.get((family, g))
                print(f"{family + f' T={g.tokens} B={g.seqs} M={g.blocks}':30} {f'[{g.tokens}]':>10} "
                      f"{f'[{g.seqs},{g.blocks}]':>13} {f'{run:.2f}s' if run is not None else '-':>8}", file=log)
    weights = size.get(WEIGHTS) or size.get(MINDIR_WEIGHTS) or 0
    for rank in manifest.ranks:
        held = size.get(rank_file(WEIGHTS, rank.folder)) or size[rank_file(MINDIR_WEIGHTS, rank.folder)]
        print(f"rank {rank.rank}: heads {rank.heads}, KV heads {rank.kv_heads}, intermediate {rank.intermediate}; "
              f"weights {held / 1e6:.1f} MB", file=log)
        weights += held
    print(f"weights {weights / 1e6:.1f} MB stored once for all "
          f"{sum(len(f.gears) for f in manifest.families.values())} buckets; artifact {out} written in {seconds:.1f}s "
          f"(every gear: `pagedgraph inspect --artifact {shlex.quote(str(out))} --gears`, or export with --verbose)",
          file=log)
    have = available_memory()
    if have is not None and weights > have:
        print(f"note: serving this artifact holds its {weights / 2**30:.1f} GiB of weights in memory (plus the KV "
              f"pool), and this machine has {have / 2**30:.1f} GiB available: it will not run here", file=log)


def family_summary(family: str, gears: Iterable[Gear]) -> str:
    """`prefill: 72 gears, T 32 64 128 ... 1792 2048 (12) x B 64 x M 1 2 4 ... 64 128 (6)`: a family's ladders."""
    gears = tuple(gears)

    def ladder(values: set[int]) -> str:
        shown = [str(v) for v in sorted(values)]
        count = f" ({len(shown)})" if len(shown) > 1 else ""
        return " ".join(shown if len(shown) <= 6 else shown[:3] + ["..."] + shown[-2:]) + count

    decode_like = all(g.tokens == g.seqs for g in gears)  # one token per sequence: T is B
    axes = " x ".join(f"{name} {ladder({getattr(g, attr) for g in gears})}"
                      for name, attr in (("T", "tokens"), ("B", "seqs"), ("M", "blocks"))
                      if not (decode_like and name == "T"))
    return f"{family}: {len(gears)} gears, {axes}"


def _versions() -> dict[str, str]:
    """The packages that made the artifact, for `pagedgraph inspect`."""
    from importlib import metadata

    found = {}
    for package in ("pagedgraph", "onnx", "onnxruntime", "mindspore", "numpy"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return found
