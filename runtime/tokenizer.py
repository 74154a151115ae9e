"""The serving-side tokenizer: encode prompts, render chat templates, stream text out.

An artifact directory carries two files, written by `pagedgraph.exporter.tokenizer_files.write_tokenizer`:

- `tokenizer.json`: an HF `tokenizers` tokenizer, verbatim.
- `tokenizer_config.json`: what generation needs besides it::

      {
        "chat_template": "{% for message in messages %}...",  // jinja2 source, or null
        "eos_token_ids": [2],        // ids that end generation
        "bos_token_id": 1,           // or null
        "add_bos_token": false       // prepend bos_token_id when encoding plain text
      }

Chat templates render exactly as transformers renders them: jinja2's sandbox with `trim_blocks`,
`lstrip_blocks`, loop controls, a `raise_exception` global and a non-escaping `tojson` filter.
"""
from __future__ import annotations

import codecs
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, Union

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders

from .sampling_params import CONTEXT_LENGTH_EXCEEDED, RequestError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
Prompt = Union[str, Sequence[int], Mapping[str, Any]]  # what `LLM` takes: text, token ids, or a request mapping


class Tokenizer:
    """An HF `tokenizers` tokenizer plus BOS/EOS handling and the model's chat template."""

    def __init__(
        self,
        backend: _Backend,
        *,
        chat_template: str | None,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None,
        add_bos_token: bool,
        source: str = "<memory>",
    ) -> None:
        self.backend = backend
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self.source = source
        self._template = _compile_template(chat_template, source) if chat_template is not None else None
        self._byte_tables = self._build_byte_tables()

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Load `tokenizer.json` + `tokenizer_config.json` from an artifact directory."""
        path = Path(path)
        tokenizer_file, config_file = path / TOKENIZER_FILE, path / TOKENIZER_CONFIG_FILE
        for file in (tokenizer_file, config_file):
            if not file.is_file():
                raise FileNotFoundError(f"{file} not found: {path} is not an exported artifact, or its export is incomplete; re-export it")
        config = json.loads(config_file.read_text(encoding="utf-8"))
        missing = [k for k in ("chat_template", "eos_token_ids", "bos_token_id", "add_bos_token") if k not in config]
        if missing:
            raise ValueError(f"{config_file}: missing field(s) {', '.join(missing)}; re-export the artifact")
        return cls(
            _Backend.from_file(str(tokenizer_file)),
            chat_template=config["chat_template"],
            eos_token_ids=config["eos_token_ids"],
            bos_token_id=config["bos_token_id"],
            add_bos_token=config["add_bos_token"],
            source=str(path),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in it (`<|im_start|>`) become their ids.

        With `add_special_tokens` the BOS token is prepended when the model wants one. A rendered chat
        template already holds its special tokens: encode it with `add_special_tokens=False`, as
        transformers does.
        """
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]).

        Extra keyword arguments (`tools`, ...) reach the template as variables. Inputs must be
        JSON data: the template is untrusted code and sees plain copies only.
        """
        if self._template is None:
            raise ValueError(
                f"{self.source}: the model has no chat template (tokenizer_config.json chat_template is null); "
                "send a plain prompt instead"
            )
        context = {
            "bos_token": self._special_text(self.bos_token_id),
            "eos_token": self._special_text(self.eos_token_ids[0] if self.eos_token_ids else None),
            # transformers always defines these, and templates test `tools is not none`
            "tools": None,
            "documents": None,
            **json.loads(json.dumps({"messages": messages, **kwargs})),
        }
        return self._template.render(context, add_generation_prompt=add_generation_prompt)

    def detokenizer(self, *, skip_special_tokens: bool = False) -> "IncrementalDetokenizer":
        """A fresh streaming decoder for one request."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens)

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """The bytes each token id decodes to when the decoder is plain ByteLevel, else None.

        Built once at load, it lets `IncrementalDetokenizer` stream with one list lookup and one
        incremental UTF-8 decode per token.
        """
        return self._byte_tables[skip_special_tokens] if self._byte_tables else None

    def _build_byte_tables(self) -> dict[bool, list[bytes]] | None:
        """Per token id, what tokenizers' ByteLevel decoder turns it into: a token spelled entirely
        in the byte alphabet maps through it, any other (an added token such as "<｜end｜>") is its
        own UTF-8. The second table blanks special tokens, for `skip_special_tokens`."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            return None
        to_bytes = str.maketrans({char: chr(byte) for char, byte in _BYTE_LEVEL_ALPHABET.items()})
        table = [b""] * self.vocab_size
        for token, token_id in self.backend.get_vocab(with_added_tokens=True).items():
            if all(c in _BYTE_LEVEL_ALPHABET for c in token):
                table[token_id] = token.translate(to_bytes).encode("latin-1")
            else:
                table[token_id] = token.encode("utf-8")
        skipping = list(table)
        for token_id, added in self.backend.get_added_tokens_decoder().items():
            if added.special:
                skipping[token_id] = b""
        return {False: table, True: skipping}

    def _special_text(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


class IncrementalDetokenizer:
    """Turns one request's generated ids into text as they arrive, one per `push`.

    `push` returns only text that is complete: a character whose UTF-8 bytes span several tokens
    (most emoji) is held back until its last byte arrives, so the stream never shows a broken
    character, and the concatenation of all pushes plus `flush()` equals `decode(all ids)`.
    Byte-level tokenizers (GPT-2/LLaMA-3/SmolLM style) cost one list lookup and one incremental UTF-8
    decode per token; other decoders (SentencePiece, byte fallback) re-decode a short window.
    """

    __slots__ = ("_table", "_utf8", "_backend", "_skip", "_ids", "_read")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._table = tokenizer.byte_table(skip_special_tokens)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        self._ids: list[int] = []  # window decoder: ids since the last emitted text's prefix
        self._read = 0  # window decoder: ids[:_read] have been emitted

    def push(self, token_id: int) -> str:
        """The text newly completed by `token_id` (often "", never a partial character)."""
        table = self._table
        if table is not None:
            # ids past the vocabulary (a padded LM head) decode to nothing, as in tokenizers
            return self._utf8.decode(table[token_id] if 0 <= token_id < len(table) else b"")
        return self._push_window(token_id)

    def flush(self) -> str:
        """What is still held back at the end of the request (incomplete bytes become U+FFFD)."""
        if self._table is not None:
            return self._utf8.decode(b"", final=True)
        text = self._decode(self._ids)[len(self._decode(self._ids[: self._read])) :]
        self._ids.clear()
        self._read = 0
        return text

    def _push_window(self, token_id: int) -> str:
        # Decoders such as SentencePiece's strip or add spaces depending on the neighbouring
        # tokens, so new text is the difference between decoding the window with and without the
        # unread ids; the window starts at the previously emitted ids, which give that context.
        ids = self._ids
        ids.append(token_id)
        done = self._decode(ids[: self._read])
        text = self._decode(ids)
        if len(text) <= len(done) or text.endswith("\ufffd"):
            return ""
        del ids[: self._read]
        self._read = len(ids)
        return text[len(done) :]

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)


def _compile_template(source_text: str, source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source_text)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"{source}: chat template does not parse (line {err.lineno}: {err.message}); re-export the artifact") from err


def _raise_exception(message: str) -> None:
    """Lets a template reject a conversation (e.g. roles out of order) with its own message."""
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: no HTML escaping (jinja's default would turn `<` into `\\u003c`)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, as char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


_BYTE_LEVEL_ALPHABET = _byte_level_alphabet()


class PromptEncoder:
    """What a user sends (text, token ids, chat messages) becomes token ids here, for the server and `LLM` alike:
    the one place the chat template is applied. Only conversion: whether the ids can be served (max_model_len,
    vocabulary, KV pool) is checked once, by `LLMEngine.add_request`. Thread-safe (it only reads the tokenizer):
    the server runs it on its tokenizer thread."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = self._max_chars()

    def _max_chars(self) -> int | None:
        """A text longer than this cannot fit in max_model_len tokens, so it is refused before tokenizing.

        No token spells more characters than the longest vocabulary entry; a normalizer may merge
        characters, so with one there is no such bound.
        """
        backend = self.tokenizer.backend
        if backend.normalizer is not None:
            return None
        return self.max_model_len * max(len(token) for token in backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str, field: str = "prompt", add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; a text that cannot fit is refused unread. `field` names it in errors."""
        if self.max_chars is not None and len(text) > self.max_chars:
            raise RequestError(field, f"the prompt is {len(text)} characters, more than {self.max_chars} (the longest "
                                      f"token times max_model_len); this model's max_model_len is "
                                      f"{self.max_model_len}, so prompts must be at most {self.max_model_len - 1} "
                                      f"tokens", CONTEXT_LENGTH_EXCEEDED)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise RequestError(field, f"the prompt is not valid Unicode ({exc.reason} at character {exc.start}): "
                                      "send UTF-8 text") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, **template_vars: Any) -> tuple[str, list[int]]:
        """The chat template's text for `messages` (ending in the assistant's turn) and its token ids.

        `template_vars` (`tools`, ...) reach the template. The rendered text holds its special tokens,
        so by default it is encoded without adding any, as transformers does.
        """
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, **template_vars)
        except (ValueError, jinja2.TemplateError) as exc:
            raise RequestError("messages", f"the chat template rejected the messages: {exc}") from None
        return text, self.encode(text, "messages", add_special_tokens)

    def token_ids(self, prompt: Prompt) -> list[int]:
        """`LLM`'s prompts: text, token ids, or a mapping with one of prompt, prompt_token_ids, messages."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"])
            if "messages" in prompt:
                return self.encode_chat(prompt["messages"])[1]
            if "prompt" in prompt:
                return self.encode(prompt["prompt"])
            raise RequestError("prompt", "a request needs one of prompt, prompt_token_ids or messages")
        return list(prompt)
