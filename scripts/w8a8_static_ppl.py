"""Held-out perplexity of the Ascend W8A8 form (MindIE's static activation scales) against float32, per
SmoothQuant alpha, through the op references: nothing here runs QuantBatchMatmul, so the graph is evaluated by
graphs/reference.NumpyBuilder with Linear.w8a8_static's integer products in float64 (exact), float32 compute.

A measurement script only (docs/performance.md, "W8A8 on Ascend"); the export's own functions make the weights
and scales, so it measures what `pagedgraph export --quantization w8a8 --target ascend` writes:

    python scripts/w8a8_static_ppl.py --alpha none --alpha 0.5 --alpha 0.8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from pagedgraph.exporter.buckets import plan_gears
from pagedgraph.exporter.checkpoint import read_checkpoint
from pagedgraph.exporter.config import ExportConfig
from pagedgraph.exporter.export import _quantized, _w8a8_static
from pagedgraph.graphs import contract as c
from pagedgraph.graphs import models, ops, quant
from pagedgraph.graphs.contract import Gear
from pagedgraph.graphs.family import GraphOptions
from pagedgraph.graphs.ops.linear_w8a8_static import deq_scale_values, mindie_tensors
from pagedgraph.graphs.reference import NumpyBuilder
from pagedgraph.graphs.weight_forms import WeightForms
from pagedgraph.graphs.weights import graph_arrays
from pagedgraph.runtime.perplexity import plan_windows
from pagedgraph.texts import shipped_text

BLOCK = 16


class ExactW8A8(NumpyBuilder):
    """The references, with Linear.w8a8_static's int64 matmul done in float64 (exact for int8 sums, BLAS-fast)."""

    def emit(self, op: Any, *inputs: Any, **attrs: Any) -> Any:
        if op is not ops.LINEAR_W8A8_STATIC:
            return super().emit(op, *inputs, **attrs)
        x, weight, scale, offset, quant_bias, deq_scale = inputs
        codes = np.clip(np.rint(x / scale) + offset, -128, 127).astype(np.float64)
        return ((codes @ weight.astype(np.float64).T + quant_bias) * deq_scale_values(deq_scale)).astype(np.float32)


def static_form(raw: Any, alpha: str, context: int) -> tuple[dict[str, np.ndarray], WeightForms]:
    """The graph arrays and forms of the Ascend w8a8 export at SmoothQuant `alpha` ("none": no migration)."""
    config = ExportConfig.model_validate({
        "model": {"quantization": "w8a8", "dtype": "float16"},
        "export": {"formats": ["mindir"], "target": "ascend", "max_model_len": 2048,
                   "w8a8_smoothing": None if alpha == "none" else float(alpha),
                   "buckets": {"prefill_tokens": [context], "decode_batch": [1], "prefill_max_seqs": 1}}})
    quantized, static = _w8a8_static(raw, _quantized(raw, config, sys.stderr), config,
                                     plan_gears(raw.config, config.export), shipped_text("calibration"), sys.stderr)
    weights = models.graph_weights(raw.config, quantized.tensors, context)
    arrays = graph_arrays({k: w for k, w in weights.items() if not isinstance(w, quant.Int8PerChannel)})
    for name, (scale, offset) in static.items():  # MindIE's tensors (float32 deq_scale: the bfloat16 model's)
        arrays.update(zip(quant.w8a8_static_parts(name), mindie_tensors(weights[name], None, scale, offset, False)))
    return arrays, WeightForms.of(weights, 0, static)


def perplexity(config: Any, weights: dict[str, np.ndarray], forms: WeightForms, tokens: list[int],
               context: int) -> tuple[float, int]:
    """Windows of `context` tokens, each prefilled alone; every position's logits score the next token."""
    gear = Gear(context, context, context // BLOCK)
    nll, scored = 0.0, 0
    for w in plan_windows(len(tokens), context, context):
        ids = tokens[w.begin:w.end]
        n, blocks = len(ids), -(-len(ids) // BLOCK)
        feed = {k: np.zeros(s, c.INPUT_DTYPES[k]) for k, s in gear.input_shapes().items()}
        feed[c.INPUT_IDS][:n], feed[c.POSITIONS][:n] = ids, np.arange(n)
        feed[c.SLOT_MAPPING][:n] = BLOCK + np.arange(n)
        feed[c.BLOCK_TABLES][0, :blocks] = np.arange(1, blocks + 1)
        feed[c.CONTEXT_LENS][0], feed[c.CU_SEQLENS_Q][1:] = n, n
        feed[c.LOGITS_INDICES][:] = np.minimum(np.arange(context), n - 1)
        for name in c.cache_names(config.num_layers):
            feed[name] = np.zeros(((gear.blocks + 1) * BLOCK, config.kv_size), np.float32)
        builder = ExactW8A8(feed, weights)
        models.build(builder, config, GraphOptions(BLOCK, forms))
        logits = builder.outputs[c.LOGITS][:n].astype(np.float64)
        logp = logits - logits.max(1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(1, keepdims=True))
        first = w.first_scored - w.begin
        nll -= logp[np.arange(first - 1, n - 1), ids[first:]].sum()
        scored += n - first
    return float(np.exp(nll / scored)), scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alpha", action="append", default=[], help="SmoothQuant alpha, or none (repeatable)")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    raw = read_checkpoint("default")
    forms = {"float32": (models.graph_weights(raw.config, raw.tensors, args.context), WeightForms())}
    forms.update({f"w8a8_static alpha={a}": static_form(raw, a, args.context) for a in args.alpha})
    tokenizer = Tokenizer.from_str(raw.tokenizer.tokenizer_json)
    tokens = tokenizer.encode(shipped_text("heldout"), add_special_tokens=False).ids
    results = {}
    for label, (weights, weight_forms) in forms.items():
        start = time.perf_counter()
        ppl, scored = perplexity(raw.config, weights, weight_forms, tokens, args.context)
        results[label] = {"perplexity": ppl, "scored": scored, "seconds": time.perf_counter() - start,
                          "vs_float32": ppl / results["float32"]["perplexity"] if results else 1.0}
        print(label, results[label], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
