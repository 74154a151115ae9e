"""What a user sends (text, token ids, chat messages) becomes token ids here, for the server and `LLM` alike.

The one place the chat template is applied. Only conversion happens here; whether the ids can be served
(max_model_len, vocabulary, KV pool) is checked once, by `LLMEngine.add_request`.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence, Union

import jinja2

from runtime.sampling_params import CONTEXT_LENGTH_EXCEEDED, RequestError
from runtime.tokenizer import Tokenizer

Prompt = Union[str, Sequence[int], Mapping[str, Any]]


class PromptEncoder:
    """Thread-safe (it only reads the tokenizer): the server runs it on its tokenizer thread."""

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
