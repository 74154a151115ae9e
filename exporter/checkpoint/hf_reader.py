"""Read a Hugging Face checkpoint directory: config.json, safetensors weights, tokenizer files.

Everything the exporter needs is checked here, before any graph is built, so a checkpoint
we cannot run faithfully (sliding-window attention, unsupported rope scaling, extra
weights) fails with a message naming the file, the field and the fix. The model's family
(graphs/models, found by config.json's `architectures`) reads its fields and names its tensors.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Container, Iterable

import numpy as np
from safetensors import SafetensorError, safe_open
from tokenizers import Tokenizer

from .base import Checkpoint, CheckpointError, LazyTensors, TokenizerSpec
from .hf_quantized import PackedFormat, packed_format
from ...graphs import models
from ...graphs.config import ModelConfig, Pooling
from ...graphs.models import hf_config
from ...graphs.quant import Weight

# Buffers some exporters saved alongside the weights; recomputed from rope_theta by the graph.
_IGNORED_TENSOR = re.compile(r"\.rotary_emb\.(inv_freq|cos_cached|sin_cached)$")
_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}
MODEL_PREFIX = "model."  # the causal LM's name for its base model
_REDOWNLOAD = "re-download it (if it is a Git LFS pointer, run `git lfs pull`)"


def read_hf_dir(path: str | os.PathLike[str], pooling: Pooling | None = None) -> Checkpoint:
    """Read an HF directory of a registered family (graphs/models) into float32 tensors under its names; a GPTQ or AWQ
    checkpoint's linears stay in their own blocks (`BlockQuantized`, Checkpoint.quantization says which).

    With a `pooling` head (an embedding export) the LM head is neither needed nor read. The weights may be those of
    the family's base model, without its `model.` prefix, as Qwen3-Embedding ships them."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; pass a Hugging Face checkpoint directory")
    hf = _read_json(root / "config.json", required=True)
    config = _model_config(hf)
    tokenizer = _read_tokenizer(root, hf)
    config = dataclasses.replace(config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids,
                                 pooling=pooling)
    packed = _packed_format(root, hf)
    tensors = _read_tensors(root, config, packed)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, source=str(root),
                      quantization=packed.method if packed else "none",
                      generation_defaults=generation_defaults(_read_json(root / "generation_config.json")),
                      generation_source=str(root / "generation_config.json"))


# generation_config.json keys that are sampling defaults, as vLLM reads them (do_sample is ignored, as there),
# mapped to SamplingParams' names.
GENERATION_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty"}


def generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """The sampling defaults a generation_config.json sets, under SamplingParams' names."""
    return {ours: generation[theirs] for theirs, ours in GENERATION_KEYS.items()
            if isinstance(generation.get(theirs), (int, float)) and not isinstance(generation.get(theirs), bool)}


def _packed_format(root: Path, hf: dict[str, Any]) -> PackedFormat | None:
    """config.json's quantization_config (transformers, vLLM), else AutoGPTQ's own quantize_config.json."""
    if hf.get("quantization_config"):
        return packed_format(hf["quantization_config"], "config.json")
    legacy = _read_json(root / "quantize_config.json")
    return packed_format({"quant_method": "gptq", **legacy}, "quantize_config.json") if legacy else None


def _read_json(path: Path, *, required: bool = False) -> dict[str, Any]:
    """Load a JSON object; an absent optional file reads as {}."""
    if not path.is_file():
        if required:
            raise CheckpointError(
                f"{path} not found: a Hugging Face checkpoint directory needs {path.name} "
                "(download the full model repository, not only the weights)"
            )
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc}); {_REDOWNLOAD}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object; {_REDOWNLOAD}")
    return data


# --- config ---------------------------------------------------------------------------------


def _model_config(hf: dict[str, Any]) -> ModelConfig:
    """Dims, rope and flags as the family of `architectures` reads them; token ids are filled in from the tokenizer
    files."""
    try:
        family = models.for_hf_classes(hf.get("architectures") or [])
        return family.config(hf)
    except models.UnknownArchitecture as exc:
        missing = hf_config.moe_variants(hf)  # a MoE model beyond routed experts: say what it needs
        raise CheckpointError(f"config.json: {exc}" + (f"; this Mixture-of-Experts model needs what the graphs do "
                                                       f"not implement: {'; '.join(missing)}" if missing else "")
                              ) from exc
    except ValueError as exc:
        raise CheckpointError(f"config.json: {exc}") from exc


# --- tokenizer ------------------------------------------------------------------------------


def _token_id(tokenizer: Tokenizer, token: Any, field_name: str) -> int | None:
    """Resolve a tokenizer_config token (a string or an AddedToken dict) to its id."""
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise CheckpointError(
            f"tokenizer_config.json: {field_name} {token!r} is not in tokenizer.json's vocabulary; "
            "fix the token string or re-download the tokenizer files together"
        )
    return token_id


def _ids(value: Any) -> list[int]:
    """generation_config/config eos_token_id may be null, an int, or a list of ints."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template(root: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """transformers >= 4.43 may save the template as chat_template.jinja instead of in the config."""
    jinja = root / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: generation uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


def _read_tokenizer(root: Path, hf: dict[str, Any]) -> TokenizerSpec:
    """tokenizer.json plus the token ids, template and BOS rule generation needs.

    `add_bos_token` follows tokenizer_config.json when it says so, else whether tokenizer.json
    itself prepends BOS, so the spec matches what transformers' tokenizer would produce.
    """
    path = root / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(
            f"{path} not found: pagedgraph needs the fast tokenizer file; if the model only ships "
            "tokenizer.model, convert it with transformers (AutoTokenizer.from_pretrained(dir)."
            "save_pretrained(dir)) and retry"
        )
    text = path.read_text(encoding="utf-8")
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        raise CheckpointError(f"{path} cannot be loaded by `tokenizers` ({exc}); {_REDOWNLOAD}") from exc
    tokenizer_config = _read_json(root / "tokenizer_config.json")
    generation = _read_json(root / "generation_config.json")

    bos = _token_id(tokenizer, tokenizer_config.get("bos_token"), "bos_token")
    if bos is None:
        bos = generation.get("bos_token_id", hf.get("bos_token_id"))
    eos_tokenizer = _token_id(tokenizer, tokenizer_config.get("eos_token"), "eos_token")
    # Union of every declared stop token, generation_config first (it is what generate() uses).
    eos = _ids(generation.get("eos_token_id")) + _ids(eos_tokenizer) + _ids(hf.get("eos_token_id"))

    add_bos = tokenizer_config.get("add_bos_token")
    if add_bos is None:  # transformers >= 5 encodes the choice in tokenizer.json's post-processor
        add_bos = bos is not None and tokenizer.encode("a").ids[:1] == [bos]
    return TokenizerSpec(
        tokenizer_json=text,
        chat_template=_chat_template(root, tokenizer_config),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=bos,
        add_bos_token=bool(add_bos),
    )


# --- tensors --------------------------------------------------------------------------------


def _weight_files(root: Path) -> list[Path]:
    index_path = root / _INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: missing or empty 'weight_map'; {_REDOWNLOAD}")
        files = [root / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index_path} lists shard(s) not in {root}: {', '.join(missing)}; download all shards"
            )
        return files
    if (root / _SINGLE_FILE).is_file():
        return [root / _SINGLE_FILE]
    found = sorted(p.name for p in root.iterdir() if p.suffix in {".bin", ".pt", ".pth"})
    hint = (
        f" (found {', '.join(found)}: convert to safetensors, e.g. transformers "
        "from_pretrained(dir).save_pretrained(dir))"
        if found
        else ""
    )
    raise CheckpointError(f"{root}: neither {_SINGLE_FILE} nor {_INDEX_FILE} found{hint}")


def _open(path: Path) -> Any:
    """safe_open with a corrupt or truncated file reported as a CheckpointError."""
    try:
        return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}); {_REDOWNLOAD}") from exc


# safetensors dtype -> what numpy reads it as (BF16: the raw 16 bits, widened in `_read_tensor`)
_NUMPY_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "F64": "<f8", "I32": "<i4", "I64": "<i8"}


def _header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where a safetensors file's data begins, and its header (each tensor's dtype, shape and byte range).

    safe_open has already checked that the ranges cover the file."""
    with path.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return 8 + size, json.loads(f.read(size))


def _read_tensor(path: Path, begin: int, entry: dict[str, Any], expert: int | None = None,
                 rows: slice | None = None) -> np.ndarray:
    """One tensor, read into a buffer of its own: float tensors as float32, integer ones (GPTQ/AWQ parts) as they
    are. numpy has no bfloat16: bf16 is the top half of a float32, so its bits widen by << 16. Nothing of the file
    stays mapped or cached here, so reading a whole checkpoint holds one tensor at a time (plain reads: faulting a
    mapping in page by page took twice as long here, docs/performance.md).

    `rows` (of expert `expert`, where the tensor is a stack [E, rows, in]): only those consecutive rows, one
    expert's part of a stacked tensor (graphs/family.py, GraphWeight.layouts), read alone."""
    start, end = entry["data_offsets"]
    shape = tuple(entry["shape"])
    itemsize = np.dtype(_NUMPY_DTYPES[entry["dtype"]]).itemsize
    if rows is not None:
        row_shape = shape[2:] if expert is not None else shape[1:]
        row_bytes = itemsize * int(np.prod(row_shape, dtype=np.int64))
        first = rows.start + (0 if expert is None else expert * shape[1])
        start, end = start + first * row_bytes, start + (first + rows.stop - rows.start) * row_bytes
        shape = (rows.stop - rows.start, *row_shape)
    raw = np.empty(shape, _NUMPY_DTYPES[entry["dtype"]])
    view = memoryview(raw.reshape(-1)).cast("B")
    with path.open("rb", buffering=0) as f:
        f.seek(begin + start)
        done = 0
        while done < end - start:  # one read returns at most 2 GiB on Linux
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{path} ends inside tensor data (truncated); {_REDOWNLOAD}")
            done += got
    if entry["dtype"] == "BF16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32) if entry["dtype"] in _FLOAT_DTYPES and entry["dtype"] != "F32" else raw


def _read_tensors(root: Path, config: ModelConfig, packed: PackedFormat | None) -> LazyTensors:
    """Validate names, shapes and dtypes of every file first; each tensor is then read when accessed.

    With a `packed` format, a linear `X.weight` may instead be stored as its `X.qweight`, `X.qzeros`, `X.scales`
    (GPTQ: `X.g_idx`): it becomes a `BlockQuantized` of the checkpoint's own codes (hf_quantized.py)."""
    expected, layouts = models.checkpoint_shapes(config), models.layout_shapes(config)
    plan: dict[Path, dict[str, str]] = {}  # file -> {tensor name: safetensors dtype}
    stored: dict[str, set[str]] = {}  # packed linear's canonical name -> the parts found
    unexpected: list[str] = []
    in_file: dict[str, str] = {}  # a tensor's name -> its name in the file, where that lacks the `model.` prefix
    for path in _weight_files(root):
        plan[path] = {}
        with _open(path) as f:
            for key in f.keys():
                name = _prefixed(key, expected)
                if _IGNORED_TENSOR.search(name) or (name.startswith("lm_head.") and "lm_head.weight" not in expected):
                    continue  # a tied head, or one an embedding export does not read
                if name != key:
                    in_file[name] = key
                info = f.get_slice(key)
                shape, dtype = tuple(info.get_shape()), info.get_dtype()
                base, _, suffix = name.rpartition(".")
                linear = f"{base}.weight"
                if packed is not None and suffix in packed.suffixes and len(expected.get(linear, ())) == 2:
                    if linear not in stored:
                        packed.check_dims(linear, *expected[linear])
                    part = packed.parts(*expected[linear])[suffix]
                    _check_tensor(path, name, shape, dtype, part.shape, part.dtypes, packed.method)
                    stored.setdefault(linear, set()).add(suffix)
                elif name in expected or name in layouts:
                    _check_tensor(path, name, shape, dtype, expected.get(name) or layouts[name], _FLOAT_DTYPES, None)
                else:
                    unexpected.append(name)
                    continue
                plan[path][name] = dtype
    if unexpected:
        raise CheckpointError(
            f"{root}: unexpected tensors for a {config.architecture} model: {_first(sorted(unexpected))}; "
            "they would be silently ignored, so the weights do not match config.json "
            "(adapters, quantization or a different architecture?)"
        )
    found = {name for names in plan.values() for name in names}
    try:
        sliced = models.relayout(config, found)  # experts stored stacked, a router under another name
    except ValueError as exc:
        raise CheckpointError(f"{root}: {exc}") from exc
    unused = sorted(name for name in found if name in layouts and not any(s.tensor == name for s in sliced.values()))
    if unused:
        raise CheckpointError(f"{root}: {_first(unused)} hold only part of a layout {config.architecture} reads; "
                              "the weights are incomplete or mix layouts: re-download them")
    missing = [name for name in expected if name not in found and name not in stored and name not in sliced]
    if packed is not None:
        missing += [f"{linear[:-len('weight')]}{part}" for linear, parts in stored.items()
                    for part in packed.required if part not in parts]
        if not stored:
            raise CheckpointError(
                f"{root}: config.json's quantization_config says {packed.method}, but no linear is stored as "
                f"{packed.method} blocks (X.qweight, X.qzeros, X.scales), only float weights; remove "
                "quantization_config from config.json to read them as float weights, or re-download the checkpoint")
        both = [linear for linear in stored if linear in found]
        if both:
            raise CheckpointError(f"{root}: {_first(both)} stored both as float weights and as {packed.method} "
                                  "blocks; keep one of them (re-download the checkpoint)")
    if missing:
        raise CheckpointError(
            f"{root}: missing tensor(s) {_first(missing)}; the weights are incomplete or config.json "
            f"does not match them (tie_word_embeddings={config.tie_word_embeddings}, "
            f"num_hidden_layers={config.num_layers}); re-download the weights"
        )

    located: dict[str, tuple[Path, int, dict[str, Any]]] = {}
    for path, names in plan.items():
        begin, header = _header(path)
        located |= {name: (path, begin, header[in_file.get(name, name)]) for name in names}
    loaders: dict[str, Callable[[], Weight]] = {name: functools.partial(_read_tensor, *located[name])
                                                for name in expected if name in located}
    loaders |= {name: functools.partial(_read_tensor, *located[where.tensor], where.expert, where.rows)
                for name, where in sliced.items()}
    for linear in stored if packed is not None else ():
        base = linear[:-len("weight")]
        parts = {suffix: located[base + suffix] for suffix in packed.suffixes if base + suffix in located}
        if "g_idx" in parts:
            packed.check_g_idx(base[:-1], _read_tensor(*parts["g_idx"]), expected[linear][1])
        loaders[linear] = functools.partial(_read_packed, packed, base[:-1], parts, expected[linear])
    return LazyTensors(loaders)


def _prefixed(name: str, expected: Container[str]) -> str:
    """`name` under the family's names: a base model's tensor (`layers.0.mlp.up_proj.weight`, saved from Qwen3Model
    or LlamaModel) gains the `model.` prefix its causal LM gives it (as transformers and vLLM load such weights)."""
    prefixed = f"{MODEL_PREFIX}{name}"
    return prefixed if not name.startswith(MODEL_PREFIX) and prefixed in expected else name


def _read_packed(packed: PackedFormat, name: str, parts: dict[str, tuple[Path, int, dict[str, Any]]],
                 shape: tuple[int, ...]) -> Weight:
    """A GPTQ / AWQ linear from its stored parts, as MatMulNBits blocks."""
    return packed.weight(name, {suffix: _read_tensor(*where) for suffix, where in parts.items()}, *shape)


def _check_tensor(path: Path, name: str, shape: tuple[int, ...], dtype: str, want: tuple[int, ...],
                  dtypes: Iterable[str], method: str | None) -> None:
    """One stored tensor against the shape config.json implies and the dtypes its form allows."""
    form = f"its {method} blocks imply" if method else "config.json implies"
    if shape != want:
        raise CheckpointError(
            f"{path.name}: {name} has shape {list(shape)} but {form} {list(want)}; config.json does not match the "
            "weights (check hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, "
            "vocab_size, and quantization_config's bits and group_size) or re-download both from the same revision"
        )
    if dtype not in dtypes:
        kind = (f"{method}'s {name.rpartition('.')[2]} is {'/'.join(dtypes)}" if method else
                "only float weights (F32/F16/BF16/F64) are read, and quantized ones from GPTQ/AWQ checkpoints "
                "with a quantization_config")
        raise CheckpointError(f"{path.name}: {name} has dtype {dtype}; {kind}: use the original weights "
                              "or re-download the checkpoint")


def _first(names: list[str], limit: int = 5) -> str:
    """A readable list of names for an error message."""
    return ", ".join(names[:limit]) + (f" (and {len(names) - limit} more)" if len(names) > limit else "")
