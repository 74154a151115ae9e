"""Tiny GPTQ and AWQ checkpoints packed by the formats' own libraries, and those libraries' dequantization.

The codes are packed by auto-gptq 0.7.1 (`qlinear_cuda.QuantLinear.pack`, its default QuantLinear, the v1 `gptq`
checkpoint format that GPTQModel also writes by default) and autoawq 0.2.9 (`WQLinear_GEMM.from_linear`), and read
back by their own torch code (`QuantLinear.forward`'s dequantization by g_idx on CPU,
`packing_utils.dequantize_gemm`), so the layouts the reader decodes are the libraries', not a guess checked
against itself. `quantize_awq` runs AutoAWQ's own quantizer (scale and clipping search, then its packer) and
`save_quantized` instead, as scripts/awq_checkpoint.py does on the real model. Both packages are installed without
their dependencies (scripts/test.sh) and imported without running their top-level `__init__`, which imports
GPU-era transformers APIs (scripts/library_modules.py).
"""
from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from scripts.library_modules import LibraryMissing, bare_module

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


def library_module(module: str) -> types.ModuleType:
    """`module` of an installed library (scripts/library_modules.py); the test is skipped if it is not installed."""
    try:
        return bare_module(module)
    except LibraryMissing as exc:
        pytest.skip(str(exc))


def _linear_names(state: dict[str, Any]) -> list[str]:
    return sorted(name[:-len(".weight")] for name in state
                  if name.endswith(".weight") and any(f".{linear}." in name + "." for linear in LINEARS))


def _write(src: Path, out: Path, state: dict[str, Any], quantization_config: dict[str, Any]) -> None:
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(src, out)
    save_file({name: t.contiguous() for name, t in state.items()}, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))


def write_gptq(src: Path, out: Path, bits: int, group_size: int, sym: bool,
               checkpoint_format: str = "gptq") -> dict[str, np.ndarray]:
    """The float checkpoint `src` with every linear GPTQ-packed by auto-gptq (scales and zeros from its min-max
    `Quantizer`, codes by its `quantize`), written to `out`; returns auto-gptq's float32 dequantization of each
    linear as stored, [out, in], under its `.weight` name.

    `checkpoint_format` gptq_v2 (GPTQModel's internal form: zeros stored as they are) is made from the v1 zeros
    with GPTQModel's own conversion, adding 1 to every packed zero (one integer add of 0x11111111 for 4 bits)."""
    import torch
    from safetensors.torch import load_file

    qlinear = library_module("auto_gptq.nn_modules.qlinear.qlinear_cuda")
    quantizer = library_module("auto_gptq.quantization.quantizer")
    state = load_file(str(src / "model.safetensors"))
    for base in _linear_names(state):
        w = state.pop(f"{base}.weight").float()
        n, k = w.shape
        group = k if group_size == -1 else group_size
        scales, zeros, grid = [], [], []
        for start in range(0, k, group):
            q = quantizer.Quantizer()
            q.configure(bits, perchannel=True, sym=sym)
            q.find_params(w[:, start:start + group], weight=True)
            scale = q.scale.half().float()  # the checkpoint stores fp16 scales
            scales.append(scale)
            zeros.append(q.zero)
            grid.append(quantizer.quantize(w[:, start:start + group], scale, q.zero, q.maxq))
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = torch.cat(grid, 1)
        module = qlinear.QuantLinear(bits, group_size, k, n, bias=False)
        module.pack(linear, torch.cat(scales, 1), torch.cat(zeros, 1), None)
        state |= {f"{base}.qweight": module.qweight, f"{base}.qzeros": module.qzeros,
                  f"{base}.scales": module.scales.half(), f"{base}.g_idx": module.g_idx}
    dequantized = gptq_dequantized(state, bits, group_size)
    if checkpoint_format == "gptq_v2":
        state |= {name: t + int(sum(1 << s for s in range(0, 32, bits))) for name, t in state.items()
                  if name.endswith(".qzeros")}
    _write(src, out, state, {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym,
                             "desc_act": False, "static_groups": False, "true_sequential": True,
                             "damp_percent": 0.01, "checkpoint_format": checkpoint_format})
    return dequantized


def gptq_dequantized(state: dict[str, Any], bits: int, group_size: int) -> dict[str, np.ndarray]:
    """auto-gptq's dequantization of every packed linear of `state` (v1 zeros), in float32: the CPU path of
    `QuantLinear.forward` on an identity input."""
    import torch

    qlinear = library_module("auto_gptq.nn_modules.qlinear.qlinear_cuda")
    out = {}
    for name in [n for n in state if n.endswith(".qweight")]:
        base = name[:-len(".qweight")]
        k, n = state[name].shape[0] * 32 // bits, state[name].shape[1]
        module = qlinear.QuantLinear(bits, group_size, k, n, bias=False)
        module.qweight, module.qzeros, module.g_idx = state[name], state[f"{base}.qzeros"], state[f"{base}.g_idx"]
        module.scales = state[f"{base}.scales"].float()
        with torch.no_grad():
            out[f"{base}.weight"] = module(torch.eye(k)).T.contiguous().numpy()
    return out


def write_awq(src: Path, out: Path, group_size: int) -> dict[str, np.ndarray]:
    """The float checkpoint `src` with every linear packed by autoawq's GEMM layout (asymmetric min-max groups,
    fp16 scales), written to `out`; returns autoawq's float32 `dequantize_gemm` of each, [out, in]."""
    import torch
    from safetensors.torch import load_file

    gemm = library_module("awq.modules.linear.gemm")
    state = load_file(str(src / "model.safetensors"))
    for base in _linear_names(state):
        w = state.pop(f"{base}.weight").float()
        n, k = w.shape
        groups = w.reshape(n, k // group_size, group_size)
        low, high = groups.amin(2), groups.amax(2)
        scale = ((high - low) / 15).clamp(min=1e-5).half().float()
        zero = torch.clamp(torch.round(-low / scale), 0, 15)
        codes = torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, 15)
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data = ((codes - zero[..., None]) * scale[..., None]).reshape(n, k)
        module = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scale.T.contiguous(),
                                                zeros=zero.T.contiguous())
        state |= {f"{base}.qweight": module.qweight, f"{base}.qzeros": module.qzeros, f"{base}.scales": module.scales}
    _write(src, out, state, {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                             "version": "gemm", "modules_to_not_convert": None})
    return awq_dequantized(state, group_size)


def awq_dequantized(state: dict[str, Any], group_size: int) -> dict[str, np.ndarray]:
    """autoawq's float32 `dequantize_gemm` of every GEMM-packed linear of `state`, [out, in], under its `.weight`
    name."""
    packing = library_module("awq.utils.packing_utils")
    return {f"{name[:-len('.qweight')]}.weight": packing.dequantize_gemm(
                state[name], state[name.replace(".qweight", ".qzeros")],
                state[name.replace(".qweight", ".scales")].float(), 4, group_size).T.contiguous().numpy()
            for name in state if name.endswith(".qweight")}


def quantize_awq(src: Path, out: Path, group_size: int, windows: list[list[int]]) -> dict[str, np.ndarray]:
    """`src` quantized by AutoAWQ's own quantizer as scripts/awq_checkpoint.py runs it on the real model (its
    activation-aware scale search and clipping search on `windows`, then its GEMM packing) and written by its
    `save_quantized` to `out` (tokenizer files copied from `src`); returns `awq_dequantized` of the file."""
    import shutil

    from safetensors.torch import load_file

    from scripts.awq_checkpoint import awq_quantize

    try:
        awq_quantize(src, out, group_size, windows)
    except LibraryMissing as exc:
        pytest.skip(str(exc))
    for tokenizer_file in src.glob("*token*"):
        shutil.copy(tokenizer_file, out)
    return awq_dequantized(load_file(str(out / "model.safetensors")), group_size)
