"""Make an HF AWQ checkpoint of the default model (SmolLM2-135M) with AutoAWQ's own quantizer on CPU, to measure
`quantization: awq` on a real model (docs/performance.md, "Precision").

transformers reads the default GGUF in float32 and saves it as an HF directory (`<out>/float`, as
scripts/gptq_checkpoint.py does); autoawq 0.2.9 loads that directory in float32
(`LlamaAWQForCausalLM.from_pretrained`), and its `quantize` (`AwqQuantizer`: per layer, the activation-aware
per-channel scale search, with a fix for CPU tensors (`awq_quantize`), and the weight clipping search, then min-max
4-bit groups with zero points) runs on the shipped calibration text (`--windows` windows of `--context` tokens,
passed as token lists; AutoAWQ joins them and cuts blocks of `--context`, dropping the remainder);
`save_quantized` writes `<out>/awq` in the GEMM layout.
AutoAWQ needs every linear's input width to be a multiple of the group: the default group is the largest of 128,
64 and 32 that divides them (64 for SmolLM2's 576 inputs).
Needs torch, transformers, accelerate and autoawq (`pip install --no-deps autoawq==0.2.9`); `datasets`, which
autoawq imports for hub calibration sets only, is not needed. Preload tcmalloc (Debian's libtcmalloc-minimal4):
AutoAWQ's clipping search allocates and frees tensors of hundreds of MB in a loop, which glibc's malloc maps and
unmaps each time, so the run spends more time in page faults than in arithmetic.

    LD_PRELOAD=libtcmalloc_minimal.so.4 python scripts/awq_checkpoint.py --out /tmp/smollm2-awq [--group-size 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.hf_float_checkpoint import add_arguments, calibration_windows, save_float_checkpoint  # noqa: E402
from scripts.library_modules import autoawq  # noqa: E402

GROUPS = (128, 64, 32)


def input_widths(config: Any) -> set[int]:
    """The input widths of a Llama layer's linears (q/k/v/gate/up, o, down)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {config.hidden_size, config.num_attention_heads * head_dim, config.intermediate_size}


def group_size(config: Any, asked: int | None) -> int:
    """`asked`, else the largest of GROUPS dividing every input width; AutoAWQ asserts that the group divides."""
    widths = input_widths(config)
    fits = [g for g in GROUPS if all(w % g == 0 for w in widths)]
    if asked is None and fits:
        return fits[0]
    if asked is None or any(w % asked for w in widths):
        raise SystemExit(f"--group-size {asked}: AutoAWQ needs a group dividing every linear's input width "
                         f"{sorted(widths)}; use one of {fits or 'a smaller power of two'}")
    return asked


def _copied(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, metadata: Any) -> None:
    """A state_dict post-hook: the values are copies, not the module's own tensors."""
    for name, tensor in state_dict.items():
        state_dict[name] = tensor.clone()


def awq_quantize(float_dir: Path, out: Path, group: int, windows: list[list[int]]) -> None:
    """`float_dir` (an HF Llama directory) loaded by AutoAWQ in float32, quantized on the token `windows` (4 bits,
    zero points, groups of `group`, GEMM) and written by its `save_quantized` to `out`.

    AutoAWQ 0.2.9's scale search runs with one fix for CPU tensors: `_compute_best_scale` snapshots the inspected
    module as `{k: v.cpu() for k, v in state_dict().items()}` and restores it after each grid point, but `.cpu()`
    copies only off the CPU. On CPU the snapshot aliases the weights the search then scales in place, so every grid
    point after the first was scored on weights already scaled by the first one's scales, and each searched linear
    was left multiplied by them (greedy output of the real model: one token repeated). The subclass (AutoAWQ's
    `quantizer_cls` hook) makes that snapshot copy."""
    class CpuAwqQuantizer(autoawq("awq.quantize.quantizer").AwqQuantizer):  # type: ignore[misc]
        def _compute_best_scale(self, x: Any, w_mean: Any, x_mean: Any, module2inspect: torch.nn.Module,
                                linears2scale: Any, fp16_output: Any, kwargs: Any = None) -> Any:
            handle = module2inspect.register_state_dict_post_hook(_copied)
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect, linears2scale, fp16_output,
                                                   kwargs or {})
            finally:
                handle.remove()

    llama = autoawq("awq.models.llama").LlamaAWQForCausalLM
    model = llama.from_pretrained(str(float_dir), "llama", torch_dtype=torch.float32, device_map="cpu")
    model.quantize(None, quant_config={"zero_point": True, "q_group_size": group, "w_bit": 4, "version": "GEMM"},
                   calib_data=windows, max_calib_samples=len(windows), max_calib_seq_len=len(windows[0]),
                   quantizer_cls=CpuAwqQuantizer)
    model.save_quantized(str(out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--group-size", type=int, help="default: the largest of 128, 64, 32 the dims allow")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    float_dir, awq_dir = args.out / "float", args.out / "awq"
    float_model, tokenizer = save_float_checkpoint(float_dir)
    group = group_size(float_model.config, args.group_size)
    del float_model
    windows = calibration_windows(tokenizer, args.windows, args.context)
    awq_quantize(float_dir, awq_dir, group, windows)
    tokenizer.save_pretrained(awq_dir)
    print(json.dumps({"float": str(float_dir), "awq": str(awq_dir), "group_size": group,
                      "calibration_tokens": sum(map(len, windows)) // args.context * args.context,
                      "awq_bytes": sum(p.stat().st_size for p in awq_dir.glob("*.safetensors")),
                      "quantization_config": json.loads((awq_dir / "config.json").read_text())["quantization_config"],
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
