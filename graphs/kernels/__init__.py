"""pagedgraph's own C++ kernels for the fused ops (CPU, float32), built from these sources on first use.

Both the exporter (it names the library in CPU MINDIR graphs) and the runtime (it loads it to
run them) import this package. `binding` calls the same C API directly from numpy; the ONNX
Runtime executor registers `ort_library_path()`, the same kernels as custom ops of domain `atb`.
"""
from graphs.kernels.build import KernelBuildError, library_path, ort_library_path

# ort_headers (OrtHeaderError) is left to its importers: `python -m graphs.kernels.ort_headers` runs it.
__all__ = ["KernelBuildError", "library_path", "ort_library_path"]
