"""A long stage's progress bar with its ETA: tqdm's redrawn bar on a terminal, whole lines anywhere else.

tqdm redraws its line with carriage returns, which a pipe, a CI log or `nohup`'s file keeps as one run-together
line; off a terminal the same bar is written as a line every `LINE_INTERVAL_S` seconds and a last line when the
stage ends, so a 10-minute 7B conversion leaves a readable log with its ETA.
"""
from __future__ import annotations

from typing import TextIO

from tqdm import tqdm

LINE_INTERVAL_S = 30.0


class _Lines:
    """The stream tqdm writes to off a terminal: each redraw becomes one line, blank clears are dropped."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def stage_bar(stream: TextIO, total: float, desc: str, unit: str = "", unit_scale: bool = True) -> tqdm:
    """A bar over `total` units for one stage; it stays on the terminal's line only while the stage runs."""
    if stream.isatty():
        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=stream, mininterval=1.0,
                    leave=False)
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, file=_Lines(stream),
                mininterval=LINE_INTERVAL_S, maxinterval=LINE_INTERVAL_S, ncols=100, leave=True)
