#!/usr/bin/env python
"""Bisect batch variance one op at a time: does a row's result depend on what else is in the batch?

    python scripts/batch_invariance.py [--custom-ops on|off] [--threads 2]

Each op of a bucket graph runs alone in ONNX Runtime, as the exporter lowers it (weights as initializers, so
prepacking and kernel choice are those of a served graph), at SmolLM2-135M's shapes:

- row-wise ops (every Linear variant, DynamicQuant, RmsNorm, SwiGLU): the first and last rows of one [M, K] input,
  M = 2 to 2,048, against each row alone (M = 1) and against it with one zero row after it (M = 2), apart for odd
  and even M: with block-quantized linears the runtime runs even row counts only (runtime/model_runner.py), so for
  Linear.block_quantized those must match, for every other op the row alone must;
- PagedAttention per cache dtype, decode: one sequence's row alone against it among 2, 7 and 16 other sequences;
- PagedAttention per cache dtype, chunking: a prompt's row at position p in prefill chunks of 2 to 200 rows, at
  different places in the chunk (so in tiles of 1 to 16 rows), beside a decode row, over the same pools. A
  one-query step is a decode row, computed another way: the scheduler never makes a prompt chunk of one token
  (runtime/scheduler.py).

A line per case: how many rows differ bit for bit from M = 1 and the largest difference; exit status 1 if any
does. docs/performance.md ("Batch invariance") records what it found.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper

from pagedgraph.exporter.onnx.graph_builder import op_model
from pagedgraph.exporter.quantize import int4_groupwise, int8_per_channel
from pagedgraph.graphs import ops
from pagedgraph.graphs.kv_cache import KV_CACHE_DTYPES, cache_format, int8_params, to_cache
from pagedgraph.graphs.ops.linear_bf16 import to_bfloat16
from pagedgraph.graphs.ops.op import Op
from pagedgraph.graphs.quant import Int8PerChannel, graph_arrays, int8_graph_arrays
from pagedgraph.cpu_kernels.int8_gemm import fit_int8_gemm

HIDDEN, INTERMEDIATE, VOCAB, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 576, 1536, 49152, 9, 3, 64, 16
BATCHES = (2, 7, 16, 17, 64, 65, 300, 2048)


@dataclass(frozen=True)
class Case:
    """One op with its constant inputs (initializers: the graph's weights) and a maker of its row input."""

    label: str
    op: Op
    constants: dict[str, np.ndarray]
    attrs: dict[str, Any]
    width: int  # K of the row input x


def _weight(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return rng.normal(0, 0.05, (n, k)).astype(np.float32)


def linear_cases(rng: np.random.Generator) -> Iterator[Case]:
    """Every shipped linear form at QKV's shape (K 576 -> N 960), the down projection's (1536 -> 576) and the LM
    head's (576 -> 49,152)."""
    for k, n in ((HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM), (INTERMEDIATE, HIDDEN), (HIDDEN, VOCAB)):
        w = _weight(rng, n, k)
        shape = f"{k}->{n}"
        yield Case(f"Linear fp32 {shape}", ops.LINEAR, {"weight": w}, {}, k)
        yield Case(f"Linear.bfloat16 {shape}", ops.LINEAR_BF16, {"weight": to_bfloat16(w)}, dict(K=k, N=n), k)
        q = Int8PerChannel.quantize(w)
        arrays = int8_graph_arrays("w", q)
        codes, scale = (arrays[name] for name in sorted(arrays))
        yield Case(f"Linear.w8a8 {shape}", ops.LINEAR_W8A8, {"weight": codes, "scale": scale}, dict(K=k, N=n), k)
        for label, bq in (("int8 rtn", int8_per_channel(w)), ("int4 g32", int4_groupwise(w, 32))):
            parts = graph_arrays("w", bq)
            constants = {"codes": parts["w.codes"], "scales": parts["w.scales"]}
            constants |= {name: parts[f"w.{name}"] for name in ("zero_points", "minimum_t") if f"w.{name}" in parts}
            for level in (0, 4):
                yield Case(f"Linear.block_quantized {label} level {level} {shape}", ops.LINEAR_BLOCK_QUANTIZED,
                           constants, dict(K=k, N=n, bits=bq.bits, block_size=bq.block_size, accuracy_level=level), k)
    yield Case("DynamicQuant", ops.DYNAMIC_QUANT, {}, {}, HIDDEN)
    yield Case("RmsNorm", ops.RMS_NORM, {"weight": rng.normal(1, 0.1, HIDDEN).astype(np.float32)},
               dict(epsilon=1e-5), HIDDEN)
    yield Case("SwiGLU", ops.SWIGLU, {}, {}, 2 * INTERMEDIATE)


def _model(case: Case, x: np.ndarray) -> bytes:
    """The op's model with its constants moved from graph inputs to initializers."""
    inputs = [x if spec.name == "x" else case.constants.get(spec.name) for spec in case.op.inputs]
    model = op_model(case.op, inputs, case.attrs)
    graph = model.graph
    keep = [i for i in graph.input if i.name not in case.constants]
    del graph.input[:]
    graph.input.extend(keep)
    for name, array in case.constants.items():
        if array.dtype.name == "bfloat16":
            tensor = onnx.helper.make_tensor(name, TensorProto.BFLOAT16, array.shape,
                                             array.view(np.uint16).tobytes(), raw=True)
        else:
            tensor = numpy_helper.from_array(array, name)
        graph.initializer.append(tensor)
    fit_int8_gemm(model)  # as the runtime loads it on this CPU
    return model.SerializeToString()


def session(model: bytes, library: str | None, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    if library:
        options.register_custom_ops_library(library)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _first_output(s: ort.InferenceSession, feed: dict[str, np.ndarray]) -> np.ndarray:
    return s.run(None, feed)[0]


def rowwise(case: Case, library: str | None, threads: int, rng: np.random.Generator) -> list[Tally]:
    """The first and last 8 rows of each batch of BATCHES against the same row alone (M = 1), and against it
    with one zero row after it (M = 2), the latter for odd and for even M apart."""
    rows = rng.normal(0, 1, (max(BATCHES), case.width)).astype(np.float32)
    rows[3, 17] *= 40  # an outlier channel in one row
    s = session(_model(case, rows[:1]), library, threads)
    zero = np.zeros((1, case.width), np.float32)
    picked = {m: sorted(set(range(min(8, m))) | set(range(max(0, m - 8), m))) for m in BATCHES}
    wanted = sorted(set().union(*picked.values()))
    alone = {m: {i: _first_output(s, {"x": np.concatenate([rows[i:i + 1], zero][:m])})[0] for i in wanted}
             for m in (1, 2)}
    tallies = [Tally(), Tally(), Tally()]
    for m in BATCHES:
        got = _first_output(s, {"x": rows[:m]})
        for i in picked[m]:
            tallies[0].add(got[i], alone[1][i])
            tallies[2 if m % 2 == 0 else 1].add(got[i], alone[2][i])
    return tallies


@dataclass
class Tally:
    """Rows compared, rows differing bit for bit, the largest difference."""

    compared: int = 0
    differ: int = 0
    gap: float = 0.0

    def add(self, got: np.ndarray, want: np.ndarray) -> None:
        self.compared += 1
        self.differ += int(np.any(got != want))
        self.gap = max(self.gap, float(np.abs(got.astype(np.float64) - want).max()))

    def __str__(self) -> str:
        return f"{self.differ:>4} / {self.compared:<4} gap {self.gap:<8.2g}"


# -- attention ----------------------------------------------------------------------------------------------
def _pools(rng: np.random.Generator, dtype: str, slots: int) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    width = KV_HEADS * HEAD_DIM
    k = rng.normal(0, 1, (slots, width)).astype(np.float32)
    v = rng.normal(0, 1, (slots, width)).astype(np.float32)
    if not cache_format(dtype).quantized:
        fmt = cache_format(dtype).numpy_dtype
        return k.astype(fmt), v.astype(fmt), []
    pk = pv = int8_params(np.full(width, -4.0), np.full(width, 4.0))
    return (to_cache(k, np.int8, pk["inv_scale"], pk["offset"]), to_cache(v, np.int8, pv["inv_scale"], pv["offset"]),
            [pk["scale"], pk["offset"], pv["scale"], pv["offset"]])


@dataclass(frozen=True)
class Step:
    """One PagedAttention call's sequences: (query rows, context length after the step) each, in packed order."""

    seqs: Sequence[tuple[int, int]]


def attention(dtype: str, library: str | None, threads: int, step: Step, query: np.ndarray, tables: np.ndarray,
              pools: tuple) -> np.ndarray:
    _, attend = ops.KV_CACHE_OPS[dtype]
    k_cache, v_cache, params = pools
    q_lens = [q for q, _ in step.seqs]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    inputs = [query[:cu[-1]], k_cache, v_cache, tables[:len(q_lens)], np.array([c for _, c in step.seqs], np.int32),
              cu, *params]
    attrs = dict(head_num=HEADS, kv_head_num=KV_HEADS, head_dim=HEAD_DIM, qk_scale=HEAD_DIM ** -0.5, block_size=BLOCK)
    model = op_model(attend, inputs, attrs)
    s = session(model.SerializeToString(), library, threads)
    names = [spec.name for spec in attend.inputs][:len(inputs)]
    feed = {}
    for name, array in zip(names, inputs):
        if array.dtype.name == "bfloat16":
            feed[name] = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), TensorProto.BFLOAT16)
        else:
            feed[name] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))
    return s.run_with_ort_values(None, feed)[0].numpy()


def attention_cases(library: str | None, threads: int,
                    rng: np.random.Generator) -> Iterator[tuple[str, int, int, float]]:
    """(label, rows differing, rows compared, largest gap) per cache dtype: decode in batches, and chunking."""
    contexts = [1000, 37, 300, 64, 129, 5, 700, 17, 450, 90, 33, 260, 800, 48, 16, 610, 75]
    max_blocks = 64
    tables = rng.permutation(np.arange(1, 1 + len(contexts) * max_blocks)).astype(np.int32).reshape(len(contexts), -1)
    query = rng.normal(0, 1, (2048, HEADS * HEAD_DIM)).astype(np.float32)
    for dtype in KV_CACHE_DTYPES:
        pools = _pools(rng, dtype, (1 + len(contexts) * max_blocks) * BLOCK)
        run = lambda st, q: attention(dtype, library, threads, st, q, tables, pools)  # noqa: E731
        alone = run(Step([(1, contexts[0])]), query)[0]
        differ = 0
        gap = 0.0
        for b in (3, 8, 17):
            got = run(Step([(1, c) for c in contexts[:b]]), query)[0]
            differ += int(np.any(got != alone))
            gap = max(gap, float(np.abs(got - alone).max()))
        yield f"PagedAttention.{dtype} decode row, B=1 vs 3/8/17", differ, 3, gap
        ctx = contexts[0]  # the row under test is at position ctx - 1; queries of positions before it precede it
        q = np.concatenate([query[1:ctx], query[:1]])
        want = run(Step([(2, ctx)]), q[ctx - 2:])[1]
        differ = 0
        gap = 0.0
        shapes = ((17, 0), (64, 0), (200, 0), (40, 1), (40, 7))  # (chunk rows, rows of the chunk after it)
        for chunk, after in shapes:
            start = ctx - chunk + after  # the chunk covers positions start .. start + chunk - 1
            rows = np.concatenate([q, query[1:1 + after]])[start:start + chunk]
            step = Step([(chunk, start + chunk), (1, contexts[1])])  # beside a decode row
            got = run(step, np.concatenate([rows, query[:1]]))[chunk - 1 - after]
            differ += int(np.any(got != want))
            gap = max(gap, float(np.abs(got - want).max()))
        yield f"PagedAttention.{dtype} prompt row in chunks/tiles of 2..200 rows", differ, len(shapes), gap


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--custom-ops", choices=("on", "off"), default="on")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="run the cases whose label contains this text")
    args = parser.parse_args(argv)
    library = None
    if args.custom_ops == "on":
        from pagedgraph.cpu_kernels.build import ort_library_path
        library = str(ort_library_path())
    rng = np.random.default_rng(0)
    failed = False  # a row that differs where the runtime relies on it (runtime/model_runner.py: even M is padded for)
    print(f"{'case':<56} {'vs M=1, any M':<26} {'vs M=2, odd M':<26} {'vs M=2, even M':<26}")
    for case in linear_cases(rng):
        if args.only in case.label:
            single, odd, even = rowwise(case, library, args.threads, rng)
            failed |= (even if case.op is ops.LINEAR_BLOCK_QUANTIZED else single).differ > 0
            print(f"{case.label:<56} {single} {odd} {even}", flush=True)
    if "PagedAttention".startswith(args.only) or args.only.startswith("PagedAttention"):
        for label, differ, compared, gap in attention_cases(library, args.threads, rng):
            failed |= differ > 0
            print(f"{label:<56} {Tally(compared, differ, gap)}", flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
