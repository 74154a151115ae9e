"""ONNX Runtime executor (an `Executor`, runtime/executors.py): one session for all bucket families, pools
updated in place.

Each per-layer pool of the KVPools is one OrtValue bound as both the pool input and its aliased output,
so the cache write (ScatterND, or the custom kernel below) goes into it without a copy; one
IOBinding per gear is built once and reused, its input OrtValues wrapping the packer's numpy
buffers (refilled in place).

With pagedgraph's custom-op library registered, PagedAttention, ReshapeAndCache, SelfAttention, Rope
and SwiGLU each run as one C++ kernel (cpu_kernels/ort_ops.cc) instead of their inlined function bodies:
ORT prefers a registered kernel to a model-local function, so the artifact stays unchanged.
"""
from __future__ import annotations

import ctypes
import logging
import os
from functools import cache
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import onnxruntime as ort
from onnxruntime.capi.onnxruntime_pybind11_state import Fail

from ..artifact.manifest import Manifest
from ..graphs import contract as c
from ..graphs.contract import Gear
from ..cpu_kernels.build import KernelBuildError, ort_library_path
from ..cpu_kernels.int8_gemm import cpu_session, shifted_dir
from ..cpu_kernels.ort_headers import FETCH_COMMAND, OrtHeaderError
from ..cpu_kernels.ort_ops import bf16_linear_supported
from .kv_pools import KVPools

log = logging.getLogger(__name__)
# Whether the fused ops run as pagedgraph's C++ custom ops: "auto" falls back when they cannot be built.
CustomOps = Literal["auto", "on", "off"]
CUSTOM_OPS: tuple[CustomOps, ...] = get_args(CustomOps)


def check_custom_ops(mode: str) -> None:
    """One error for every place the setting enters (EngineConfig, the executor), naming the allowed values."""
    if mode not in CUSTOM_OPS:
        raise ValueError(f"custom_ops = {mode!r}: choose one of {', '.join(CUSTOM_OPS)}")


def session_options(threads: int | None, prepack: bool = True) -> ort.SessionOptions:
    """The engine's ONNX Runtime settings; the naive baseline uses them too, so both run alike.

    Prepacking stays on; `prepack` False is there to measure it (scripts/prepack_bench.py). Off, the weights stay
    one mapped copy and load takes no time, but MatMulNBits dequantizes its blocks on every call (45x slower at a
    1.1B decode step); on, the packed copy is the one copy: ORT drops each mapped original once it is packed, and
    page_out_weights gives back what is left (docs/performance.md, "Real model sizes")."""
    options = ort.SessionOptions()
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Workers spin inside a step (a decode step is hundreds of short kernels, and waking a sleeping
    # worker for each is slow) and stop when the step returns, so they never take the cores the host
    # loop needs between steps. With another process on the cores, spinning costs instead: then
    # OMP_WAIT_POLICY=PASSIVE, OpenMP's own switch (oneDNN's pool follows it), turns it off here too.
    # Figures: docs/performance.md, "Kernel and graph choices".
    spin = os.environ.get("OMP_WAIT_POLICY", "").strip().upper() != "PASSIVE"
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    # Memory patterns are cached per input-shape set (one per gear here) and add to the peak RSS
    # without making steps faster (docs/performance.md, "Kernel and graph choices").
    options.enable_mem_pattern = False
    return options


MADV_RANDOM = 1  # no readahead on a fault: read the faulting page only
MADV_PAGEOUT = 21  # Linux 5.4+: reclaim the range's pages now (their data is kept: a later read faults them back)
M_MMAP_THRESHOLD = -3  # glibc mallopt: blocks at least this large are mmapped, and unmapped when freed
LARGE_BLOCK = 1 << 20


def run_options() -> ort.RunOptions:
    """Every step's run options: ORT frees the arena regions left wholly unused when the step returns.

    Without it the arena keeps every region it ever grew: a 2,048-token prefill's activations (~50 MiB) stayed
    resident for good, and the regions grown for different gears added up (docs/performance.md,
    "Memory"). Decode steps fit in the regions that hold the prepacked weights, which are never freed."""
    options = ort.RunOptions()
    options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
    return options


def unmap_large_blocks() -> None:
    """Make glibc unmap every freed block of >= 1 MiB (process-wide) and give back the heap's free pages now.

    The arena's regions are malloc'd; glibc raises its mmap threshold to the largest block freed (up to 32 MiB),
    so after the first shrinkage the regions ORT gives back would stay in the heap, resident. A fixed threshold
    stops that adjustment. The trim returns what loading freed (the tokenizer's JSON, the session's graph
    building: 5-8 MiB). Other C libraries have no mallopt or malloc_trim: nothing changes there."""
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    malloc_trim.argtypes = [ctypes.c_size_t]
    mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK)
    malloc_trim(0)


def page_out_weights(*directories: Path) -> None:
    """Give back the resident pages of `directories`' files that ONNX Runtime still maps once a session is built.

    ORT maps the external weights file and keeps the mapping after prepacking a weight into its own buffer
    (MatMulNBits, Gemm): the pages prepacking read stay resident, though only the unpacked readers (the embedding's
    Gather, BlockMinimum's minima, the norms) read the file again, and those pages fault back in on use (measured
    in docs/performance.md, "Memory"). MADV_PAGEOUT is reclaim, not discard, so it is safe on any mapping; where
    it or /proc/self/maps is missing (Linux < 5.4, other systems) nothing changes.

    The mappings are also advised MADV_RANDOM: the Gather reads scattered embedding rows, and a fault would read
    ahead and map up to 128 KiB around each row it touches (a run of random prompt tokens brought back nearly the
    whole float32 table; "Memory")."""
    roots = tuple(str(directory.resolve()) + "/" for directory in directories)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:  # "start-end perms offset dev inode path"
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip().startswith(roots):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for start, end in ranges:
        madvise(start, end - start, MADV_RANDOM)
        madvise(start, end - start, MADV_PAGEOUT)


@cache
def _warn_fallback(reason: str) -> None:
    """Once per process and reason: every executor after the first falls back for the same cause."""
    log.warning("pagedgraph's ONNX Runtime custom ops are unavailable, running the fused ops' ONNX function "
                "bodies instead (slower); `%s` fetches the header they need. Cause: %s", FETCH_COMMAND, reason)


def register_custom_ops(options: ort.SessionOptions, mode: CustomOps) -> bool:
    """Register the custom-op library per `mode`; whether it was.

    "auto" falls back to the function bodies when the library cannot be built (no ORT header, no
    compiler) or loaded (an onnxruntime older than the header), "on" raises instead, "off" never registers.
    """
    check_custom_ops(mode)
    if mode == "off":
        return False
    try:
        options.register_custom_ops_library(str(ort_library_path()))
    except (OrtHeaderError, KernelBuildError, Fail) as error:  # Fail: this onnxruntime predates the header's API
        if mode == "on":
            raise
        _warn_fallback(str(error))
        return False
    return True


def pool_values(pools: KVPools, rank: int = 0) -> dict[str, ort.OrtValue]:
    """Each pool (of tensor-parallel rank `rank`) as an OrtValue over its own memory, by its bits: ORT's numpy bridge
    has no bfloat16 (the OrtValue still wraps the array, no copy)."""
    fmt = pools.format
    return {name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a.view(f"u{fmt.itemsize}"), fmt.onnx_type)
            for name, a in pools.rank(rank).items()}


def step_binding(session: ort.InferenceSession, inputs: dict[str, np.ndarray], pools: dict[str, ort.OrtValue],
                 output: str, rows: np.ndarray) -> ort.IOBinding:
    """A step's binding: the inputs the graph reads and its head's `output` (logits or pooled rows) by their
    buffers, each KV pool as both the input and the output of its layer, so ReshapeAndCache writes in place (a run
    without it copies every pool per call)."""
    binding = session.io_binding()
    read = {i.name for i in session.get_inputs()}  # a mean-pooling graph reads no logits_indices
    for name, array in inputs.items():
        if name in read:
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
    for name, value in pools.items():
        binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_output(c.cache_output_name(name), value)
    binding.bind_ortvalue_output(output, ort.OrtValue.ortvalue_from_numpy(rows))
    return binding


class OrtExecutor:
    def __init__(self, artifact: Path, manifest: Manifest, pools: KVPools, threads: int | None = None,
                 custom_ops: CustomOps = "auto") -> None:
        options = session_options(threads)
        # Whether the fused ops run as pagedgraph's C++ kernels ("auto" may have fallen back).
        self.custom_ops = register_custom_ops(options, custom_ops)
        if manifest.dtype == "bfloat16" and not (self.custom_ops and bf16_linear_supported()):
            log.warning("Linear.bfloat16 runs its float32 ONNX body (%s): its weights are widened to float32 in "
                        "memory, twice the artifact's", "custom ops off" if not self.custom_ops else
                        "oneDNN has no bfloat16 matmul on this CPU, which needs AVX-512 BF16 or AMX")
        # The graph whose pools hold `kv_cache_dtype` (one per exported cache dtype, sharing the weights).
        graph = manifest.served_graph(pools.kv_cache_dtype)
        self.session = cpu_session(Path(artifact) / graph, options)
        page_out_weights(Path(artifact) / "graphs", shifted_dir())  # shifted_dir: read-only artifacts on AVX2
        unmap_large_blocks()
        self._run_options = run_options()
        self.model = manifest.model
        self.pools = pools
        self._pool_values = pool_values(pools)
        self._bindings: dict[Gear, tuple[ort.IOBinding, np.ndarray]] = {}
        # One output buffer for all gears, each binding its first `seqs` rows: per-gear buffers were each resident
        # once written (a mixed run touches ~6 gears, ~34 MiB of logits at a 49k vocabulary; docs/performance.md,
        # 'Precision').
        rows = max(gear.seqs for family in manifest.families.values() for gear in family.gears)
        self._output, width = c.head_output(self.model)
        self._rows = np.zeros((rows, width), np.float32)

    def _binding(self, gear: Gear, inputs: dict[str, np.ndarray]) -> tuple[ort.IOBinding, np.ndarray]:
        cached = self._bindings.get(gear)
        if cached is None:
            rows = self._rows[:gear.seqs]
            cached = self._bindings[gear] = (step_binding(self.session, inputs, self._pool_values, self._output, rows),
                                             rows)
        return cached

    def run(self, gear: Gear, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """Run one step; `inputs` must be the packer's buffers for this gear (bound once, by identity). The logits
        (or pooled rows) are a view of the executor's one buffer, valid until the next run."""
        binding, logits = self._binding(gear, inputs)
        self.session.run_with_iobinding(binding, self._run_options)
        return logits
