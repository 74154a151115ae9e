"""Progress of a batch of requests on stderr: tqdm's bar on a terminal, whole lines anywhere else.

A bar redraws its line with carriage returns, which a pipe or a log file keeps as one run-together line; so
off a terminal the progress is a line every `interval_s` seconds and one summary line at the end.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

INTERVAL_S = 10.0


class RequestProgress:
    """Requests done out of `total`; `update` with the count done so far, `close` once all are."""

    def __init__(self, total: int, stream: TextIO | None = None, interval_s: float = INTERVAL_S) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total, self.interval_s = total, interval_s
        self.started = self._shown = time.perf_counter()
        self.done = 0
        self._bar = tqdm(total=total, unit="request", file=self.stream) if self.stream.isatty() else None

    def update(self, done: int) -> None:
        if done == self.done:
            return
        if self._bar is not None:
            self._bar.update(done - self.done)
        elif time.perf_counter() - self._shown >= self.interval_s and done < self.total:
            self._line(f"{done}/{self.total} requests done")
        self.done = done

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            self._line(f"{self.done}/{self.total} requests done in {time.perf_counter() - self.started:.1f} s")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)
        self._shown = time.perf_counter()
