"""The texts shipped for measuring precisions (pagedgraph/data/): calibration input and a held-out evaluation text.

Package data, so a source tree and an installed wheel resolve them alike. Library code (perplexity,
calibration of static scales) takes the text as an argument; the CLI supplies these defaults.
Calibration reads only `calibration`; perplexity targets are judged on `heldout`, which calibration
never sees.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

SHIPPED = ("calibration", "heldout")


def shipped_text(name: str) -> str:
    """The shipped text `name` (one of SHIPPED)."""
    if name not in SHIPPED:
        raise ValueError(f"text {name!r}: the shipped texts are {', '.join(SHIPPED)}")
    return files(__package__).joinpath("data", f"{name}.txt").read_text(encoding="utf-8")


def read_text(name_or_path: str) -> str:
    """A shipped text by name, else a UTF-8 file; the error names both choices."""
    if name_or_path in SHIPPED:
        return shipped_text(name_or_path)
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(f"text {name_or_path!r}: no such file; give a UTF-8 text file or a shipped "
                                f"text ({', '.join(SHIPPED)})")
    return path.read_text(encoding="utf-8")
