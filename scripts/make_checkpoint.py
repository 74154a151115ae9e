"""Write a random-weight Hugging Face checkpoint with a real model's shapes: what conversion, loading and memory are
judged on at real sizes without downloading a model.

    python scripts/make_checkpoint.py --preset 7b --out /data/ckpt-7b      # LLaMA-2-7B's layout, 12.6 GiB
    python scripts/make_checkpoint.py --preset 1.1b --layers 4 --out DIR   # TinyLlama's widths, 4 layers
    python scripts/make_checkpoint.py --preset qwen3-8b --out DIR          # Qwen3-8B's layout, 15.3 GiB
    python scripts/make_checkpoint.py --preset olmoe --out DIR             # Qwen3-MoE at OLMoE-1B-7B's shape, 12.9 GiB

A preset names a family of the model registry and its config.json fields; the tensors and their shapes are the ones
that family declares (graphs/models), so any registered family has checkpoints of any size.

The directory is what `save_pretrained` writes for a float16 model: config.json, the tokenizer files, and
safetensors shards of at most `--shard-size` bytes (HF's default 5 GB) with model.safetensors.index.json. The
tokenizer is SmolLM2's (rebuilt from the bundled GGUF by pagedgraph's own GGUF tokenizer code); a preset's
vocab_size is 49,152 (the tokenizer's) unless it gives its model's (Qwen3's 151,936 rows, as Qwen's own checkpoints
hold more rows than tokens).

Weights are drawn tensor by tensor, in chunks, and written straight into the shard files (the safetensors header
is computed from the shapes first): memory stays at a few chunks whatever the model size. Linear and embedding
weights are N(0, 0.02) (HF's `initializer_range`), norm weights 1 + N(0, 0.02): with those scales a forward pass
stays finite at every preset (a model that produces NaN would prove nothing). Values are drawn by inverse CDF over
65,536 equiprobable float16 levels, from a generator seeded per tensor: the same `--seed` writes the same bytes.
The directory appears whole (written beside it, then renamed) or not at all.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import BinaryIO, Iterator

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path  # noqa: E402
from pagedgraph.exporter.checkpoint.gguf_tokenizer import tokenizer_spec  # noqa: E402
from pagedgraph.exporter.progress import stage_bar  # noqa: E402
from pagedgraph.graphs import models  # noqa: E402

INIT_STD = 0.02  # HF LlamaConfig.initializer_range
CHUNK = 1 << 24  # elements drawn at a time (32 MiB of float16)
SHARD_SIZE = 5_000_000_000  # transformers' default max_shard_size, "5GB"
VOCAB = 49152  # SmolLM2's tokenizer


@dataclass(frozen=True)
class Preset:
    """A registered family (graphs/models) and the config.json fields that fix its tensor shapes."""

    family: str
    config: dict[str, object]

    @property
    def num_hidden_layers(self) -> int:
        return int(self.config["num_hidden_layers"])  # type: ignore[call-overload]

    def with_layers(self, layers: int) -> "Preset":
        return dataclasses.replace(self, config={**self.config, "num_hidden_layers": layers})

    def hf_config(self) -> dict[str, object]:
        family = models.family(self.family)
        return {"architectures": [family.hf_classes[0]], "model_type": family.name, "torch_dtype": "float16",
                "vocab_size": VOCAB, "hidden_act": "silu", "initializer_range": INIT_STD, "attention_bias": False,
                "mlp_bias": False, **self.config}


def _dense(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, tie: bool, positions: int, theta: float,
           eps: float, **extra: object) -> dict[str, object]:
    return dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, tie_word_embeddings=tie, max_position_embeddings=positions,
                rope_theta=theta, rms_norm_eps=eps, **extra)


PRESETS = {
    "135m": Preset("llama", _dense(576, 1536, 30, 9, 3, True, 8192, 100000.0, 1e-5)),  # SmolLM2-135M
    "1.1b": Preset("llama", _dense(2048, 5632, 22, 32, 4, False, 2048, 10000.0, 1e-5)),  # TinyLlama-1.1B
    "7b": Preset("llama", _dense(4096, 11008, 32, 32, 32, False, 4096, 10000.0, 1e-5)),  # LLaMA-2-7B
    "qwen3-1.7b": Preset("qwen3", _dense(2048, 6144, 28, 16, 8, True, 40960, 1e6, 1e-6, head_dim=128,
                                         vocab_size=151936)),  # Qwen3-1.7B
    "qwen3-8b": Preset("qwen3", _dense(4096, 12288, 36, 32, 8, False, 40960, 1e6, 1e-6, head_dim=128,
                                       vocab_size=151936)),  # Qwen3-8B
    # OLMoE-1B-7B's widths as a Qwen3-MoE model: 64 experts of width 1024 per layer, top-8, softmax weights as OLMoE
    # routes (norm_topk_prob false), every layer sparse; 6.9B parameters, 1.3B read per token; its experts stored one
    # tensor each, as transformers saves them (3,072 expert tensors)
    "olmoe": Preset("qwen3_moe", _dense(2048, 1024, 16, 16, 16, False, 4096, 10000.0, 1e-5, head_dim=128,
                                        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
                                        norm_topk_prob=False)),
}


def tensor_shapes(preset: Preset) -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint, as the preset's family declares them."""
    hf = preset.hf_config()
    return models.checkpoint_shapes(models.family(preset.family).config(hf))


def shards(shapes: dict[str, tuple[int, ...]], shard_size: int) -> list[dict[str, tuple[int, ...]]]:
    """Tensors grouped in order into shards of at most `shard_size` bytes (a larger tensor gets one alone)."""
    groups: list[dict[str, tuple[int, ...]]] = [{}]
    used = 0
    for name, dims in shapes.items():
        size = 2 * int(np.prod(dims))
        if groups[-1] and used + size > shard_size:
            groups.append({})
            used = 0
        groups[-1][name] = dims
        used += size
    return groups


def _levels() -> np.ndarray:
    """N(0, INIT_STD) as 65,536 equiprobable float16 levels (the inverse CDF at each level's midpoint)."""
    normal = NormalDist(0.0, INIT_STD)
    return np.array([normal.inv_cdf((k + 0.5) / 65536) for k in range(65536)], np.float32).astype(np.float16)


def _chunks(levels: np.ndarray, seed: int, index: int, size: int, offset: float) -> Iterator[np.ndarray]:
    rng = np.random.default_rng([seed, index])
    for begin in range(0, size, CHUNK):
        draw = levels[rng.integers(0, 65536, min(CHUNK, size - begin), dtype=np.uint16)]
        yield draw + np.float16(offset) if offset else draw


def _header(group: dict[str, tuple[int, ...]]) -> bytes:
    """The safetensors header: little-endian u64 length, then JSON padded with spaces to 8 bytes."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    begin = 0
    for name, dims in group.items():
        end = begin + 2 * int(np.prod(dims))
        entries[name] = {"dtype": "F16", "shape": list(dims), "data_offsets": [begin, end]}
        begin = end
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _write_shard(f: BinaryIO, group: dict[str, tuple[int, ...]], order: dict[str, int], levels: np.ndarray,
                 seed: int, bar: tqdm) -> None:
    f.write(_header(group))
    for name, dims in group.items():
        offset = 1.0 if len(dims) == 1 else 0.0  # norm weights around 1
        for chunk in _chunks(levels, seed, order[name], int(np.prod(dims)), offset):
            f.write(chunk.tobytes())
            bar.update(chunk.nbytes)


def _config(preset: Preset, bos: int | None, eos: tuple[int, ...]) -> dict[str, object]:
    return {**preset.hf_config(), "bos_token_id": bos, "eos_token_id": eos[0] if len(eos) == 1 else list(eos)}


def _write_tokenizer(out: Path) -> tuple[int | None, tuple[int, ...]]:
    """SmolLM2's tokenizer files, from the bundled GGUF's metadata; returns its BOS and EOS ids."""
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    path = default_model_path()
    reader = GGUFReader(path)
    spec = tokenizer_spec({key: field.contents() for key, field in reader.fields.items()}, str(path))
    (out / "tokenizer.json").write_text(spec.tokenizer_json, encoding="utf-8")
    tokenizer = Tokenizer.from_str(spec.tokenizer_json)
    token = lambda i: None if i is None else tokenizer.id_to_token(i)  # noqa: E731
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": token(spec.bos_token_id), "eos_token": token(spec.eos_token_ids[0]),
         "add_bos_token": spec.add_bos_token, "chat_template": spec.chat_template,
         "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2, ensure_ascii=False), encoding="utf-8")
    return spec.bos_token_id, spec.eos_token_ids


def write_checkpoint(out: Path, preset: Preset, seed: int = 0, shard_size: int = SHARD_SIZE,
                     progress: bool = True) -> Path:
    """Write the checkpoint of `preset` to `out` (a new path); returns `out`."""
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"--out {out} exists; give a new path (the checkpoint is never written over files)")
    shapes = tensor_shapes(preset)
    total = 2 * sum(int(np.prod(d)) for d in shapes.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < total + (64 << 20):
        raise OSError(f"{out.parent} has {free / 2**30:.1f} GiB free; this checkpoint needs {total / 2**30:.1f} GiB: "
                      "free space or choose another --out")
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        bos, eos = _write_tokenizer(staging)
        (staging / "config.json").write_text(json.dumps(_config(preset, bos, eos), indent=2))
        (staging / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": list(eos)}))
        groups = shards(shapes, shard_size)
        order = {name: i for i, name in enumerate(shapes)}
        files = ["model.safetensors"] if len(groups) == 1 else \
            [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        levels = _levels()
        with (stage_bar(sys.stderr, total, f"writing {out.name}", "B") if progress else tqdm(disable=True)) as bar:
            for name, group in zip(files, groups):
                with open(staging / name, "wb") as f:
                    _write_shard(f, group, order, levels, seed, bar)
        if len(groups) > 1:
            weight_map = {tensor: name for name, group in zip(files, groups) for tensor in group}
            (staging / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        staging.chmod(0o755)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--out", type=Path, required=True, help="a new directory")
    parser.add_argument("--layers", type=int, help="override the preset's num_hidden_layers (smaller test models)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=SHARD_SIZE, help="bytes per safetensors shard at most")
    args = parser.parse_args(argv)
    preset = PRESETS[args.preset]
    if args.layers is not None:
        if args.layers < 1:
            parser.error(f"--layers {args.layers}: give at least 1")
        preset = preset.with_layers(args.layers)
    write_checkpoint(args.out, preset, args.seed, args.shard_size)
    print(f"{args.out}: {args.preset} shapes, {preset.num_hidden_layers} layers, "
          f"{sum(p.stat().st_size for p in args.out.iterdir()) / 2**30:.2f} GiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
