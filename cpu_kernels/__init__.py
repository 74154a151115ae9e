"""pagedgraph's own C++ kernels for the fused ops (CPU, float32), built from these sources on first use.

Both the exporter (it names the library in CPU MINDIR graphs) and the runtime (it loads it to
run them) use this package: `build` compiles the libraries, `binding` calls their C API from numpy,
and the ONNX Runtime executor registers `build.ort_library_path()`, the same kernels as custom ops of
domain `atb`. This file imports nothing, so `python -m pagedgraph.cpu_kernels.ort_headers` runs that module alone.
"""
