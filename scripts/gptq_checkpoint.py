"""Make an HF GPTQ checkpoint of the default model (SmolLM2-135M) with auto-gptq's own GPTQ and packer, to measure
`quantization: gptq` on a real model (docs/performance.md, "Precision").

transformers reads the default GGUF in float32 and saves it as an HF directory (`<out>/float`); every linear of
the layers is then quantized (symmetric, both libraries' default) by auto-gptq 0.7.1's `GPTQ.fasterquant` with
Hessians from the shipped calibration text (`--windows` windows of `--context` tokens through the float model: one
pass, not layer by layer as AutoGPTQ's sequential mode does), or with `--rtn` by its min-max `Quantizer` alone
(round to nearest, the same grid without GPTQ's error compensation), and packed by its default
`QuantLinear.pack` (the v1 `gptq` format) into `<out>/gptq`.
Needs torch, transformers, accelerate and auto-gptq (`pip install --no-deps auto-gptq==0.7.1`).

    python scripts/gptq_checkpoint.py --out /tmp/smollm2-gptq --bits 4 --group-size 128 [--rtn]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.hf_float_checkpoint import add_arguments, calibration_windows, save_float_checkpoint  # noqa: E402
from scripts.library_modules import bare_module  # noqa: E402


def _round_to_nearest(quantizer: Any, layer: torch.nn.Linear, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's min-max scale and zero (auto-gptq's `Quantizer`), the layer's weight set to their grid."""
    quantize = bare_module("auto_gptq.quantization.quantizer").quantize
    w = layer.weight.data
    scales, zeros = [], []
    for begin in range(0, w.shape[1], group_size):
        group = w[:, begin:begin + group_size]
        quantizer.find_params(group, weight=True)
        w[:, begin:begin + group_size] = quantize(group, quantizer.scale, quantizer.zero, quantizer.maxq)
        scales.append(quantizer.scale)
        zeros.append(quantizer.zero)
    return torch.cat(scales, 1), torch.cat(zeros, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--rtn", action="store_true", help="round to nearest on the same grid (no calibration)")
    args = parser.parse_args(argv)
    gptq = bare_module("auto_gptq.quantization.gptq")
    qlinear = bare_module("auto_gptq.nn_modules.qlinear.qlinear_cuda")
    torch.cuda.synchronize = lambda *a, **k: None  # fasterquant times itself with it; a no-op on a CPU build

    started = time.perf_counter()
    float_dir, gptq_dir = args.out / "float", args.out / "gptq"
    model, tokenizer = save_float_checkpoint(float_dir)

    quantizers = {}
    for name, module in model.model.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            q = gptq.GPTQ(module)
            q.quantizer.configure(args.bits, perchannel=True, sym=True)
            module.register_forward_hook(lambda m, inp, out, q=q: q.add_batch(inp[0].data, out.data))
            quantizers[f"model.layers.{name}"] = q
    windows = [] if args.rtn else calibration_windows(tokenizer, args.windows, args.context)
    with torch.no_grad():
        for window in windows:
            model(torch.tensor([window]))

    state = load_file(str(float_dir / "model.safetensors"))
    for name, q in quantizers.items():
        layer = q.layer
        if args.rtn:
            scale, zero = _round_to_nearest(q.quantizer, layer, args.group_size)
            g_idx = None
        else:
            scale, zero, g_idx = q.fasterquant(blocksize=128, percdamp=0.01, group_size=args.group_size)
        packed = qlinear.QuantLinear(args.bits, args.group_size, layer.in_features, layer.out_features, bias=False)
        packed.pack(layer, scale.half().float(), zero, g_idx)  # as from an fp16 model: codes on the fp16 scales
        del state[f"{name}.weight"]
        state |= {f"{name}.qweight": packed.qweight, f"{name}.qzeros": packed.qzeros,
                  f"{name}.scales": packed.scales.half(), f"{name}.g_idx": packed.g_idx}
    shutil.copytree(float_dir, gptq_dir)
    save_file({k: v.contiguous() for k, v in state.items()}, str(gptq_dir / "model.safetensors"))
    config = json.loads((gptq_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": args.bits, "group_size": args.group_size,
                                     "sym": True, "desc_act": False, "static_groups": False,
                                     "true_sequential": False, "damp_percent": 0.01, "checkpoint_format": "gptq"}
    (gptq_dir / "config.json").write_text(json.dumps(config, indent=2))
    print(json.dumps({"float": str(float_dir), "gptq": str(gptq_dir), "linears": len(quantizers), "rtn": args.rtn,
                      "calibration_tokens": sum(map(len, windows)),
                      "gptq_bytes": (gptq_dir / "model.safetensors").stat().st_size,
                      "seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
