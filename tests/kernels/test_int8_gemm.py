"""The u8u8 rewrite of Linear.w8a8's int8 GEMM (cpu_kernels/int8_gemm.py): exact where ORT's u8s8 kernel saturates."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pagedgraph.exporter.onnx.graph_builder import op_model
from pagedgraph.graphs import ops
from pagedgraph.graphs.ops.linear_w8a8 import linear_w8a8
from pagedgraph.cpu_kernels import int8_gemm

pytestmark = pytest.mark.unit


def _saturating_case() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activations at the int8 extremes against weights of +-127 in neighbouring rows of K: every pair of products
    sums past int16 (2 x 127 x 255), the worst case for vpmaddubsw."""
    rng = np.random.default_rng(0)
    k, n = 64, 32
    x = np.where(rng.random((3, k)) < 0.5, -1.0, 1.0).astype(np.float32)
    weight = np.where(rng.random((k, n)) < 0.5, -127, 127).astype(np.int8)
    return x, weight, np.full(n, 0.01, np.float32)


def _run(model_bytes: bytes, x: np.ndarray, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "weight": weight, "scale": scale})[0]


def test_u8u8_rewrite_is_exact_on_every_cpu() -> None:
    x, weight, scale = _saturating_case()
    k, n = weight.shape
    model = op_model(ops.LINEAR_W8A8, (x, weight, scale, None), {"K": k, "N": n})
    assert int8_gemm.exact_int8_gemm(model).nodes == 1
    node = next(node for node in model.graph.node if node.op_type == "MatMulIntegerToFloat")
    assert node.input[1] == "weight.uint8" and node.input[5]
    expected = linear_w8a8(x, weight, scale, K=k, N=n)
    np.testing.assert_allclose(_run(model.SerializeToString(), x, weight, scale), expected, rtol=1e-6, atol=1e-6)
    assert int8_gemm.exact_int8_gemm(model).nodes == 0  # rewritten nodes carry a weight zero point: left alone


@pytest.mark.skipif(not int8_gemm.u8s8_saturates(), reason="this CPU has VNNI: ORT's u8s8 GEMM is exact here")
def test_the_u8s8_form_saturates_here() -> None:
    """Why the rewrite exists: on this CPU the graph as exported is off by far more than rounding."""
    x, weight, scale = _saturating_case()
    k, n = weight.shape
    model = op_model(ops.LINEAR_W8A8, (x, weight, scale, None), {"K": k, "N": n})
    got = _run(model.SerializeToString(), x, weight, scale)
    assert np.abs(got - linear_w8a8(x, weight, scale, K=k, N=n)).max() > 1.0


@pytest.mark.parametrize("machine,flags,saturates", [
    ("x86_64", "fpu avx2 fma", True),
    ("x86_64", "avx2 avx512f avx512bw", True),  # AVX-512 without VNNI: MLAS's AVX-512 kernel uses vpmaddubsw too
    ("x86_64", "avx2 avx512f avx512_vnni", False),
    ("x86_64", "avx2 avx_vnni", False),
    ("aarch64", "asimd", False),
])
def test_which_cpus_saturate(monkeypatch: pytest.MonkeyPatch, tmp_path, machine: str, flags: str,
                             saturates: bool) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(int8_gemm.platform, "machine", lambda: machine)
    monkeypatch.setattr(int8_gemm, "CPUINFO", cpuinfo)
    int8_gemm.u8s8_saturates.cache_clear()
    try:
        assert int8_gemm.u8s8_saturates() is saturates
    finally:
        int8_gemm.u8s8_saturates.cache_clear()


def test_external_weights_are_shifted_into_a_file_once(tmp_path) -> None:
    """An artifact's weights are external data: their shifted copy is a file beside them, written once per weights
    version, and the session computes exactly reading it."""
    from onnx.external_data_helper import convert_model_to_external_data

    x, weight, scale = _saturating_case()
    k, n = weight.shape
    model = op_model(ops.LINEAR_W8A8, (x, weight, scale, None), {"K": k, "N": n})
    feed = [i for i in model.graph.input if i.name != "weight"]
    del model.graph.input[:]
    model.graph.input.extend(feed)
    model.graph.initializer.append(onnx.numpy_helper.from_array(weight, "weight"))
    convert_model_to_external_data(model, location="weights.bin", size_threshold=0)
    onnx.save_model(model, tmp_path / "model.onnx")
    graph = tmp_path / "model.onnx"
    expected = linear_w8a8(x, weight, scale, K=k, N=n)
    written = []
    for _ in range(2):
        loaded = onnx.load_model(graph, load_external_data=False)
        shifted = int8_gemm.exact_int8_gemm(loaded, tmp_path)
        assert shifted.nodes == 1 and shifted.folder == tmp_path  # writable: beside weights.bin
        options = ort.SessionOptions()
        options.add_session_config_entry(int8_gemm.EXTERNAL_FOLDER, str(shifted.folder))
        session = ort.InferenceSession(loaded.SerializeToString(), options, providers=["CPUExecutionProvider"])
        got = session.run(None, {"x": x, "scale": scale})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
        shifted_file = tmp_path / int8_gemm.SHIFTED_FILE
        written.append(shifted_file.stat().st_mtime_ns)
    assert written[0] == written[1]  # the second load reused the first one's file
    onnx.load_model(graph)  # the artifact's own weights file is untouched (onnx refuses hard-linked ones)
    (tmp_path / "weights.bin").touch()  # a re-export: the shifted file is made again
    int8_gemm.exact_int8_gemm(onnx.load_model(graph, load_external_data=False), tmp_path)
    assert shifted_file.stat().st_mtime_ns != written[0]
    int8_gemm.forget_shifted(tmp_path)
    assert not shifted_file.exists()
