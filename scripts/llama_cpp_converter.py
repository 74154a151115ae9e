"""llama.cpp's own HF -> GGUF converter, as users make GGUF files: convert_hf_to_gguf.py with its `conversion`
package and gguf-py, from the llama-cpp-python sdist on PyPI, fetched once into pagedgraph's cache (never committed).

    python scripts/llama_cpp_converter.py --fetch                    # scripts/test.sh runs this
    python scripts/llama_cpp_converter.py HF_DIR OUT.gguf --outtype q8_0

The tests that read GGUF files of other families convert tiny transformers checkpoints with it
(tests/exporter/test_family_gguf.py); the peer scripts convert real-size checkpoints for llama.cpp. It imports
torch, transformers and sentencepiece (even for a BPE tokenizer).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from pagedgraph.cpu_kernels.cache import cache_root

VERSION = "0.3.36"  # llama-cpp-python: the llama.cpp the peer scripts build too
_PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class ConverterMissing(RuntimeError):
    """The converter is not in the cache: `python scripts/llama_cpp_converter.py --fetch` puts it there."""


def converter_dir() -> Path:
    return cache_root() / f"llama.cpp-{VERSION}"


def fetch() -> Path:
    """Download the sdist with pip (no build) and keep only the converter's files; nothing if already there."""
    target = converter_dir()
    if (target / "convert_hf_to_gguf.py").is_file():
        return target
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d", scratch], check=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        with tarfile.open(next(Path(scratch).glob("*.tar.gz"))) as sdist:
            for member in sdist.getmembers():
                relative = member.name[len(_PREFIX):] if member.name.startswith(_PREFIX) else ""
                if member.isfile() and relative.startswith(_MEMBERS):
                    member.name = relative
                    sdist.extract(member, staging, filter="data")
        staging.rename(target)
    return target


def convert(hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """`hf_dir` as a GGUF file at `out` (outtype: f32, f16, bf16, q8_0, ...), as llama.cpp's converter writes it."""
    root = converter_dir()
    if not (root / "convert_hf_to_gguf.py").is_file():
        raise ConverterMissing(f"llama.cpp's converter is not in {root}: run `python scripts/llama_cpp_converter.py "
                               "--fetch`")
    env = {**os.environ, "PYTHONPATH": str(root / "gguf-py")}
    run = subprocess.run([sys.executable, str(root / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(out),
                          "--outtype", outtype], env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{run.stderr[-3000:]}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fetch", action="store_true", help="put the converter in the cache and stop")
    parser.add_argument("hf_dir", nargs="?", type=Path)
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--outtype", default="f32")
    args = parser.parse_args()
    if args.fetch:
        print(fetch())
        return
    if args.hf_dir is None or args.out is None:
        parser.error("give HF_DIR and OUT.gguf (or --fetch)")
    fetch()
    print(convert(args.hf_dir, args.out, args.outtype))


if __name__ == "__main__":
    main()
