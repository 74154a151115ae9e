"""Engine outputs -> OpenAI response bodies and stream chunks, for /v1/completions and /v1/chat/completions.

A `Format` turns one HTTP request's progress into the endpoint's JSON: the whole response at the end, or
chunks of new text when streaming (`DeltaTracker` decides what is new). Both endpoints share the
envelope, usage and token rendering. An HTTP request runs one engine request per prompt (a completions
body may hold several), each with `n` completions: choice `index` is prompt index x n + completion index,
as in OpenAI's and vLLM's answers, and usage is summed over the prompts.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Sequence

from ..engine import CompletionOutput, RequestOutput
from ..tokenizer import Tokenizer


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def completions(out: RequestOutput) -> list[CompletionOutput]:
    return out.outputs or [CompletionOutput(0, out.token_ids, out.text, out.finish_reason, out.logprobs)]


def usage(outs: Sequence[RequestOutput]) -> dict[str, Any]:
    """Summed over the prompts; each prompt's tokens count once, whatever `n`."""
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    generated = sum(len(c.token_ids) for out in outs for c in completions(out))
    return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in outs)}}


class Format:
    """Shared envelope (id, created, model) and token rendering; subclasses shape the choices."""

    object = ""
    chunk_object = ""
    id_prefix = ""

    def __init__(self, model: str, tokenizer: Tokenizer, top_logprobs: int | None) -> None:
        self.id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.top_logprobs = top_logprobs
        self._tokenizer = tokenizer
        self._bytes = tokenizer.byte_table(False)

    def token(self, token_id: int) -> tuple[str, bytes]:
        """A token's own text and bytes (a partial UTF-8 character shows as U+FFFD, its bytes stay exact)."""
        raw = self._bytes[token_id] if self._bytes is not None else self._tokenizer.decode([token_id]).encode()
        return raw.decode("utf-8", errors="replace"), raw

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def response(self, outs: Sequence[RequestOutput], n: int) -> dict[str, Any]:
        """The whole answer: the choices of every prompt's `n` completions, prompt by prompt."""
        choices = [self.choice(p * n + c.index, c.text, c.token_ids, c.logprobs, c.finish_reason)
                   for p, out in enumerate(outs) for c in completions(out)]
        return {**self.envelope(self.object, choices), "usage": usage(outs)}

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> dict[str, Any]:
        return {**self.envelope(self.chunk_object, []), "usage": usage(outs)}

    def opening(self, n: int) -> list[dict[str, Any]]:
        """Chunks sent before any text (`n` completions per prompt)."""
        return []

    def choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
               finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def delta(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
              finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormat(Format):
    """`echo`: each prompt's text, put before its choices' (streamed: in a first chunk of its own)."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, tokenizer: Tokenizer, top_logprobs: int | None,
                 echo: Sequence[str] | None = None, prompt_logprobs: bool = False) -> None:
        super().__init__(model, tokenizer, top_logprobs)
        self.echo = echo  # per prompt; None: no echo
        self.prompt_logprobs = prompt_logprobs  # vLLM's `prompt_logprobs` list in each choice

    def response(self, outs: Sequence[RequestOutput], n: int) -> dict[str, Any]:
        body = super().response(outs, n)
        prompt = [self._prompt_logprobs(out) for out in outs] if self.echo is not None else None
        vllm = [self._vllm_prompt_logprobs(out) for out in outs] if self.prompt_logprobs else None
        for choice in body["choices"]:
            p = choice["index"] // n
            if self.echo is not None:
                choice["text"] = self.echo[p] + choice["text"]
            echoed = prompt[p] if prompt is not None else None
            if echoed is not None and choice["logprobs"] is not None:
                choice["logprobs"] = {key: echoed[key] + choice["logprobs"][key] for key in echoed}
            if vllm is not None:
                choice["prompt_logprobs"] = vllm[p]
        return body

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's shape: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}."""
        if out.prompt_logprobs is None:
            return None
        return [None if e is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank,
                                                 "decoded_token": self.token(t)[0]} for t, lp in e.items()}
                for e in out.prompt_logprobs]

    def _prompt_logprobs(self, out: RequestOutput) -> dict[str, list[Any]] | None:
        """The prompt's tokens in the completion logprobs shape; the first token has none (no prefix)."""
        if self.top_logprobs is None or out.prompt_logprobs is None:
            return None
        entries = out.prompt_logprobs
        return {"tokens": [self.token(t)[0] for t in out.prompt_token_ids],
                "token_logprobs": [None if e is None else e[t].logprob for t, e in zip(out.prompt_token_ids, entries)],
                "top_logprobs": [None if e is None else {self.token(alt)[0]: lp.logprob for alt, lp in e.items()}
                                 for e in entries]}

    def opening(self, n: int) -> list[dict[str, Any]]:
        if self.echo is None:
            return []
        return [self.envelope(self.chunk_object, [{"index": p * n + i, "text": text, "logprobs": None,
                                                   "finish_reason": None}
                                                  for p, text in enumerate(self.echo) for i in range(n)])]

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        return {"tokens": [self.token(t)[0] for t in token_ids],
                "token_logprobs": [lp[t] for t, lp in zip(token_ids, logprobs)],
                "top_logprobs": [{self.token(alt)[0]: value for alt, value in lp.items()} for lp in logprobs]}

    def choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
               finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(token_ids, logprobs),
                "finish_reason": finish_reason}

    delta = choice


class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self.token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _logprobs(self, token_ids: list[int], logprobs: list[dict[int, float]]) -> dict[str, Any] | None:
        if self.top_logprobs is None:
            return None
        content = []
        for t, lp in zip(token_ids, logprobs):
            best = sorted(lp.items(), key=lambda kv: -kv[1])[:self.top_logprobs]
            content.append({**self._entry(t, lp[t]), "top_logprobs": [self._entry(a, v) for a, v in best]})
        return {"content": content}

    def choice(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
               finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(token_ids, logprobs), "finish_reason": finish_reason}

    def delta(self, index: int, text: str, token_ids: list[int], logprobs: list[dict[int, float]],
              finish_reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(token_ids, logprobs), "finish_reason": finish_reason}

    def opening(self, n: int) -> list[dict[str, Any]]:
        return [self.envelope(self.chunk_object, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                   "logprobs": None, "finish_reason": None} for i in range(n)])]


class DeltaTracker:
    """What each choice has streamed so far, and the next chunk's choices.

    Text within `hold` characters of a running choice's end waits: a stop string may still cut it off,
    so the streamed text always equals the non-streamed text.
    """

    def __init__(self, fmt: Format, hold: int, n: int) -> None:
        self.fmt = fmt
        self.hold = hold
        self.n = n
        self.sent: dict[int, tuple[int, int, bool]] = {}  # choice index -> (characters, tokens, finished)

    def chunk(self, prompt: int, out: RequestOutput) -> dict[str, Any] | None:
        """The new text of prompt number `prompt`'s completions in `out`."""
        choices = []
        for c in completions(out):
            index = prompt * self.n + c.index
            chars, tokens, closed = self.sent.get(index, (0, 0, False))
            if closed:
                continue
            done = c.finish_reason is not None
            end = len(c.text) if done else len(c.text) - self.hold
            text = c.text[chars:end] if end > chars else ""
            count = len(c.token_ids)
            if text or done or (self.fmt.top_logprobs is not None and count > tokens):
                choices.append(self.fmt.delta(index, text, c.token_ids[tokens:], c.logprobs[tokens:count],
                                              c.finish_reason))
                self.sent[index] = (chars + len(text), count, done)
        return self.fmt.envelope(self.fmt.chunk_object, choices) if choices else None
