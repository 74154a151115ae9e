"""pagedgraph's own C++ kernels for the fused ops (CPU, float32), built from these sources on first use.

Both the exporter (it names the library in CPU MINDIR graphs) and the runtime (it loads it to
run them) import this package. `binding` calls the same C API directly from numpy.
"""
from graphs.kernels.build import KernelBuildError, library_path

__all__ = ["KernelBuildError", "library_path"]
