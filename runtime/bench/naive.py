"""The naive baseline runner: static batches on the artifact's contiguous-cache graph (`graphs/naive.onnx`).

What engines without paging or continuous batching do: when idle, take up to `batch_size`
arrived requests, pad every prompt to the batch's longest, prefill them together, then decode
the whole batch until its longest request is done (finished rows keep computing), each request
holding a [kv_heads, max_model_len, head_dim] cache row per layer. Same ONNX Runtime, same
session settings, same greedy sampling and detokenizer as the engine; only the graph and the
batching differ. The graph's contract is in exporter/onnx/contiguous.py.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from ...artifact.manifest import ArtifactError, Manifest, kv_variant
from ...graphs import contract as c
from ...graphs.kv_cache import cache_format
from ...cpu_kernels.int8_gemm import cpu_session
from .metrics import RunRecord
from .workloads import BenchRequest
from ..executor_ort import session_options
from ..tokenizer import Tokenizer

NAIVE_GRAPH = "graphs/naive.onnx"  # written by `pagedgraph export` when export.baseline is naive
_INPUTS = (c.INPUT_IDS, c.POSITIONS, c.SLOT_MAPPING, c.CONTEXT_LENS, c.LOGITS_INDICES)


class NaiveRunner:
    def __init__(self, artifact: str | Path, batch_size: int = 16, threads: int | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        artifact = Path(artifact)
        manifest = Manifest.load(artifact, verify=False)
        dtype = manifest.kv_cache_dtype(kv_cache_dtype, artifact)
        graph = kv_variant(NAIVE_GRAPH, dtype, manifest.dtype)  # the baseline's cache holds the same dtype
        if graph not in manifest.files:
            raise ArtifactError(f"{artifact} has no {graph}; re-export it with `export.baseline: naive` in the "
                                f"export YAML (or `pagedgraph export --baseline naive`), or run with --baseline none")
        self.session = cpu_session(artifact / graph, session_options(threads))
        self.format = cache_format(dtype)
        model = manifest.model
        self.vocab_size, self.max_len, self.batch_size = model.vocab_size, manifest.max_model_len, batch_size
        # Zeroed once: stale rows of earlier batches stay finite and are masked, like any static cache.
        self.pools = {name: np.zeros((batch_size, model.num_kv_heads, self.max_len, model.head_dim),
                                     self.format.numpy_dtype) for name in c.cache_names(model.num_layers)}
        self.tokenizer = Tokenizer.from_dir(artifact)
        self._bindings: dict[tuple[int, int], tuple[ort.IOBinding, dict[str, np.ndarray], np.ndarray]] = {}

    @property
    def kv_cache_bytes(self) -> int:
        return sum(a.nbytes for a in self.pools.values())

    def _binding(self, rows: int, tokens: int) -> tuple[ort.IOBinding, dict[str, np.ndarray], np.ndarray]:
        """Input buffers and the IOBinding for `rows` requests of `tokens // rows` tokens (made once per shape)."""
        key = (rows, tokens)
        if key not in self._bindings:
            binding = self.session.io_binding()
            sizes = {c.INPUT_IDS: tokens, c.POSITIONS: tokens, c.SLOT_MAPPING: tokens,
                     c.CONTEXT_LENS: rows, c.LOGITS_INDICES: rows}
            buffers = {name: np.zeros(sizes[name], c.INPUT_DTYPES[name]) for name in _INPUTS}
            for name, array in buffers.items():
                binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
            for name, pool in self.pools.items():
                rows_view = pool[:rows].view(f"u{self.format.itemsize}")  # the first rows: still contiguous; by bits
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(rows_view, self.format.onnx_type)
                binding.bind_ortvalue_input(name, value)
                binding.bind_ortvalue_output(c.cache_output_name(name), value)
            logits = np.zeros((rows, self.vocab_size), np.float32)
            binding.bind_ortvalue_output(c.LOGITS, ort.OrtValue.ortvalue_from_numpy(logits))
            self._bindings[key] = (binding, buffers, logits)
        return self._bindings[key]

    def _feed(self, rows: int, positions: np.ndarray, record: RunRecord) -> dict[str, np.ndarray]:
        """Fill positions/slots/context_lens for a [rows, S] step; the caller fills ids and logits_indices."""
        _, buffers, _ = self._binding(rows, positions.size)
        per_row = positions.size // rows
        buffers[c.POSITIONS][:] = positions.ravel()
        np.add(positions, (np.arange(rows) * self.max_len)[:, None], out=buffers[c.SLOT_MAPPING].reshape(rows, per_row))
        buffers[c.CONTEXT_LENS][:] = positions[:, -1] + 1
        record.tokens_computed += positions.size
        record.steps += 1
        shape = f"naive:B{rows}xS{per_row}"
        record.bucket_hits[shape] = record.bucket_hits.get(shape, 0) + 1
        return buffers

    def _run(self, rows: int, tokens: int, record: RunRecord) -> np.ndarray:
        binding, _, logits = self._binding(rows, tokens)
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        record.graph_s += time.perf_counter() - start
        return np.argmax(logits, axis=1)

    def _run_batch(self, batch: list[int], requests: list[BenchRequest], record: RunRecord) -> None:
        rows = len(batch)
        prompts = [requests[i].prompt_token_ids for i in batch]
        lengths = np.array([len(p) for p in prompts])
        wanted = np.array([requests[i].max_tokens for i in batch])
        longest = int(lengths.max())
        detok = [self.tokenizer.detokenizer(skip_special_tokens=True) for _ in batch]
        positions = np.broadcast_to(np.arange(longest), (rows, longest))
        buffers = self._feed(rows, positions, record)
        ids = buffers[c.INPUT_IDS].reshape(rows, longest)
        ids.fill(0)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = prompt
        buffers[c.LOGITS_INDICES][:] = np.arange(rows) * longest + lengths - 1
        record.tokens_real += int(lengths.sum())
        tokens = self._run(rows, rows * longest, record)
        for step in range(int(wanted.max())):
            now = time.perf_counter()
            active = np.flatnonzero(wanted > step)
            for row in active:
                record.timeline.tokens(batch[row], 1, now)
                record.outputs.setdefault(batch[row], []).append(int(tokens[row]))
                detok[row].push(int(tokens[row]))
            held = int(np.minimum(lengths + step, lengths + wanted - 1).sum())
            record.sample_kv(held, rows * self.max_len)
            record.sample_context(held, rows * self.max_len)  # attention reads every row's whole max_len
            if step + 1 == wanted.max():
                break
            # Finished rows keep decoding (static batch); their positions stop at the cache's end.
            buffers = self._feed(rows, np.minimum(lengths + step, self.max_len - 1)[:, None], record)
            buffers[c.INPUT_IDS][:] = tokens
            buffers[c.LOGITS_INDICES][:] = np.arange(rows)
            record.tokens_real += int((wanted > step + 1).sum())
            tokens = self._run(rows, rows, record)
        for d in detok:
            d.flush()

    def run(self, requests: list[BenchRequest]) -> RunRecord:
        """Serve `requests` in arrival order, a static batch at a time."""
        record = RunRecord(requests=len(requests), prompt_tokens=sum(len(r.prompt_token_ids) for r in requests),
                           output_tokens=sum(r.max_tokens for r in requests))
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in order:
            record.timeline.arrive(i, start + requests[i].arrival_s)
        busy_s, next_index = 0.0, 0
        while next_index < len(order):
            wait = start + requests[order[next_index]].arrival_s - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            now = time.perf_counter() - start
            batch = []
            while next_index < len(order) and len(batch) < self.batch_size \
                    and requests[order[next_index]].arrival_s <= now:
                batch.append(order[next_index])
                next_index += 1
            batch_start = time.perf_counter()
            self._run_batch(batch, requests, record)
            busy_s += time.perf_counter() - batch_start
        record.wall_s, record.cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        record.host_s = busy_s - record.graph_s
        return record

    def decode_step_s(self, context: int, rows: int, steps: int = 8) -> float:
        """Fastest decode step of `rows` requests at `context` tokens (cache contents do not matter)."""
        record, times = RunRecord(), []
        for step in range(steps):
            buffers = self._feed(rows, np.full((rows, 1), context - 1 + step), record)
            buffers[c.LOGITS_INDICES][:] = np.arange(rows)
            start = time.perf_counter()
            self._run(rows, rows, record)
            times.append(time.perf_counter() - start)
        return min(times)
