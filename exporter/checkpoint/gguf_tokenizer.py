"""Rebuild the HF `tokenizers` tokenizer from GGUF metadata.

A GGUF file carries no `tokenizer.json`, only llama.cpp's `tokenizer.ggml.*` keys. For byte-level
BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) those keys are enough to rebuild the tokenizer
transformers builds from the same file, token for token: BPE over the vocabulary and merges in file
order, the plain GPT-2 split regex (or the split regex of the vocabulary's `pre`, as Qwen's), a ByteLevel
decoder, and the CONTROL tokens as special added tokens. transformers is the reference; llama.cpp differs for
`pre = smollm` where 2+ spaces precede a digit (it splits digits first).
"""
from __future__ import annotations

from typing import Any, Mapping

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .base import CheckpointError, TokenizerSpec

# llama.cpp's token types (gguf.TokenType): CONTROL tokens are special, USER_DEFINED ones are
# matched whole in text but are not special.
_CONTROL = 3
_USER_DEFINED = 4

# `tokenizer.ggml.pre` values whose split regex is the plain GPT-2 one in transformers, and those with their own
# (Qwen2's tokenizer, which Qwen2.5 and Qwen3 share). Other values (llama-bpe, tekken, ...) need their own regex;
# refusing them beats tokenizing wrongly.
_GPT2_REGEX_PRE = (None, "gpt-2", "smollm")
_SPLIT_REGEX_PRE = {
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
             r"""|\s*[\r\n]+|\s+(?!\S)|\s+""",
}


def build_tokenizer(metadata: Mapping[str, Any], source: str) -> Tokenizer:
    """The byte-level BPE tokenizer the `tokenizer.ggml.*` keys of `source` describe."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') GGUF tokenizers "
            "are supported. Export from the model's HF directory instead (it carries tokenizer.json)."
        )
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in _GPT2_REGEX_PRE and pre not in _SPLIT_REGEX_PRE:
        supported = [p for p in _GPT2_REGEX_PRE if p] + list(_SPLIT_REGEX_PRE)
        raise CheckpointError(
            f"{source}: tokenizer.ggml.pre is {pre!r}, whose split regex this reader does not rebuild (supported: "
            f"{', '.join(supported)}). Export from the model's HF directory instead (it carries tokenizer.json)."
        )
    tokens: list[str] = _require(metadata, "tokenizer.ggml.tokens", source)
    merges: list[str] = _require(metadata, "tokenizer.ggml.merges", source)
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or []

    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise CheckpointError(f"{source}: tokenizer.ggml.tokens has duplicate entries; the file is corrupt")
    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False, byte_fallback=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) \
        if pre not in _SPLIT_REGEX_PRE else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRE[pre]), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(token_types) if t == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(token_types) if t == _USER_DEFINED]
    )
    return tokenizer


def eos_token_ids(metadata: Mapping[str, Any]) -> tuple[int, ...]:
    """End-of-sequence, end-of-turn and end-of-message ids, in that order, without repeats."""
    ids = (metadata.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom"))
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def tokenizer_spec(metadata: Mapping[str, Any], source: str) -> TokenizerSpec:
    """What generation needs from the tokenizer of GGUF file `source` (its metadata as a dict)."""
    bos = metadata.get("tokenizer.ggml.bos_token_id")
    return TokenizerSpec(
        tokenizer_json=build_tokenizer(metadata, source).to_str(),
        chat_template=metadata.get("tokenizer.chat_template"),
        eos_token_ids=eos_token_ids(metadata),
        bos_token_id=None if bos is None else int(bos),
        # transformers (the reference) adds no BOS to a byte-level vocabulary that does not say.
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
    )


def _require(metadata: Mapping[str, Any], key: str, source: str) -> Any:
    if key not in metadata:
        raise CheckpointError(f"{source}: metadata key {key!r} is missing; the file is incomplete or not a model file")
    return metadata[key]
