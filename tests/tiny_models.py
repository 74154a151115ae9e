"""Tiny random HF checkpoints for tests that compare our readers and graphs with transformers.

torch and transformers are imported inside the builders so this module stays importable
without them; tests that call the builders should `pytest.importorskip` both first.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedgraph.exporter.checkpoint.base import Checkpoint

TINY_DIMS: dict[str, int] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
BOS, EOS, EOT = "<s>", "</s>", "<|eot|>"
BOS_ID, EOS_ID, EOT_ID = 0, 1, 2  # trainer assigns special tokens the first ids, in order
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}" + EOT + "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, paged attention packs requests into buckets",
    "user: what is 2 + 2? assistant: 4",
]


def make_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE of at most 300 tokens that prepends BOS, like Llama's tokenizers."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_DIMS["vocab_size"],
        special_tokens=[BOS, EOS, EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS * 10, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
    )
    return tokenizer


def make_tiny_hf_checkpoint(
    out_dir: str | os.PathLike[str],
    arch: str = "llama",
    tie: bool = True,
    dtype: str = "float32",
    rope_scaling: dict[str, Any] | None = None,
    shard: bool = False,
    dims: dict[str, Any] | None = None,
    tokenizer: Tokenizer | None = None,
    fused_experts: bool = False,
) -> Path:
    """Save a 2-layer GQA model of a registered family (`arch`: its name; transformers' class for it is the family's
    first HF class) plus tokenizer files.

    Norm weights and biases are randomised too (HF initialises them to 1 and 0), so a reader
    or graph that drops or swaps them fails a comparison instead of passing by accident.
    `dtype` is a torch dtype name ("float32", "float16", "bfloat16"); `shard=True` splits the
    weights into many files with a model.safetensors.index.json; `dims` overrides entries of TINY_DIMS (and sets a
    MoE family's fields); `tokenizer` replaces the tiny one (its ids 0 and 1 become BOS and EOS; the vocabulary size
    follows it); `fused_experts` saves a MoE model's experts stacked as transformers 5 holds them
    (`save_original_format=False`) rather than one tensor per expert as the released checkpoints do.
    """
    import torch
    import transformers

    from pagedgraph.graphs import models

    model_cls = getattr(transformers, models.family(arch).hf_classes[0])
    config_cls = model_cls.config_class
    extra: dict[str, Any] = {"sliding_window": None} if arch == "mistral" else {}
    if rope_scaling is not None:
        extra["rope_scaling"] = rope_scaling
    vocabulary = tokenizer or make_tiny_tokenizer()
    config = config_cls(
        **(TINY_DIMS | (dims or {}) | {"vocab_size": vocabulary.get_vocab_size()}),
        tie_word_embeddings=tie,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=None,  # some configs default to an id past the tiny vocabulary
        initializer_range=0.1,
        **extra,
    )
    torch.manual_seed(0)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn_like(param))
    model = model.to(getattr(torch, dtype))
    model.generation_config.eos_token_id = [EOS_ID, EOT_ID]

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="20KB" if shard else "10GB", save_original_format=not fused_experts)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=vocabulary, bos_token=vocabulary.id_to_token(BOS_ID), eos_token=vocabulary.id_to_token(EOS_ID),
        chat_template=CHAT_TEMPLATE).save_pretrained(out)
    return out


def default_model_tokenizer(checkpoint: Checkpoint | None = None) -> Tokenizer:
    """SmolLM2's tokenizer (49,152 tokens, from the bundled GGUF): a real vocabulary, which llama.cpp's converter
    recognises and the shipped texts tokenize into. `checkpoint`: the GGUF already read (conftest's
    `smollm2_checkpoint`), which spares parsing it again."""
    from pagedgraph.exporter.checkpoint import read_checkpoint

    return Tokenizer.from_str((checkpoint or read_checkpoint("default")).tokenizer.tokenizer_json)
