"""Traffic traces: one request per JSON line, `{"prompt_tokens": N, "completion_tokens": M}` (OpenAI's usage names).

`pagedgraph serve` writes one (`server.request_log`) and `pagedgraph plan` fits the bucket ladders to one
(runtime/ladder_plan.py); `pagedgraph bench --workload trace` replays one with random token ids.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from ..artifact.settings import json_lines

FIELDS = ("prompt_tokens", "completion_tokens")


class TraceError(ValueError):
    """A trace line that cannot be read: the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    prompt_tokens: int
    completion_tokens: int

    def to_json(self) -> str:
        return json.dumps({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens})


def _field(item: dict, name: str, where: str, least: int) -> int:
    value = item.get(name)
    if value is None:
        raise TraceError(f"{where}: field {name!r} is missing; each line needs prompt_tokens and completion_tokens, "
                         f'e.g. {{"prompt_tokens": 120, "completion_tokens": 64}}')
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise TraceError(f"{where}: {name} = {value!r}: must be an integer >= {least}")
    return value


def read_trace(path: str | Path, max_model_len: int | None = None) -> list[TraceRequest]:
    """The requests of a trace file, in order; blank lines are skipped, other keys on a line are ignored (a request
    log may carry more). With `max_model_len`, a request whose prompt and completion do not fit it is an error."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace {path} does not exist; write one JSON object per line with prompt_tokens and "
                         "completion_tokens, or set server.request_log in a deployment to record one")
    requests = []
    for where, item in json_lines(path, TraceError):
        request = TraceRequest(_field(item, "prompt_tokens", where, 1), _field(item, "completion_tokens", where, 1))
        total = request.prompt_tokens + request.completion_tokens
        if max_model_len is not None and total > max_model_len:
            raise TraceError(f"{where}: prompt_tokens + completion_tokens = {total} exceeds max_model_len "
                             f"{max_model_len}; raise export.max_model_len, or drop the line")
        requests.append(request)
    if not requests:
        raise TraceError(f"trace {path} holds no requests")
    return requests


class RequestLog:
    """Appends one trace line per finished request (`server.request_log`); safe from any thread."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO = self.path.open("a", buffering=1)  # line-buffered: a crash loses no finished line
        self._lock = threading.Lock()

    def write(self, request: TraceRequest) -> None:
        with self._lock:
            self._file.write(request.to_json() + "\n")

    def close(self) -> None:
        with self._lock:
            self._file.close()
