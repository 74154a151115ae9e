"""Every lowering of the op set, the registry check, and docs/design.md's generated table of bodies.

`python -m pagedgraph.exporter.lowerings` prints the table; `--write docs/design.md` replaces it between the
markers there (tests/graphs/test_op_walk.py fails when the document is stale). The MindSpore lowerings
import MindSpore, an optional extra: this module needs it installed.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..artifact.settings import replace_block
from ..graphs.ops import OPS
from ..graphs.ops.op import Lowering, body_table, missing_bodies

BEGIN, END = "<!-- op-table:begin (python -m pagedgraph.exporter.lowerings --write docs/design.md) -->", "<!-- op-table:end -->"


def lowerings() -> list[Lowering[Any]]:
    """In the table's column order."""
    from .mindspore.ascend_ops import MINDSPORE_ASCEND
    from .mindspore.cpu_ops import MINDSPORE_CPU
    from .onnx.contiguous import CONTIGUOUS
    from .onnx.lowering import ONNX
    from ..cpu_kernels.binding import KERNELS
    from ..cpu_kernels.ort_ops import ORT_CUSTOM_OPS

    return [ONNX, ORT_CUSTOM_OPS, CONTIGUOUS, MINDSPORE_CPU, MINDSPORE_ASCEND, KERNELS]


def registry_report() -> dict[str, list[str]]:
    """Lowering -> op keys without a body (own or fallback's): empty when every lowering covers every op."""
    return missing_bodies(OPS, lowerings())


def table() -> str:
    found = lowerings()
    where = "\n".join(f"- {lowering.name}: `{lowering.where}`" for lowering in found)
    return f"{body_table(OPS, found)}\n\nBodies live in:\n{where}\n"


def with_table(document: str) -> str:
    """`document` with the text between the markers replaced by the current table."""
    return replace_block(document, BEGIN, END, table())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", type=Path, help="replace the table in this markdown file")
    args = parser.parse_args()
    if args.write:
        args.write.write_text(with_table(args.write.read_text()))
    else:
        print(table(), end="")


if __name__ == "__main__":
    main()
