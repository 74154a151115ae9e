"""`pagedgraph inspect`: what an artifact holds (model, dtype, bucket families, sizes, export config, versions,
checksums), read from its manifest, so nobody has to read manifest.json by hand."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .exporter.export import family_summary, head_summary
from .artifact.manifest import MANIFEST, Manifest, file_sha256
from .graphs.contract import DECODE, PREFILL


def speculation(manifest: Manifest) -> dict[str, Any]:
    """The gears speculative decoding verifies in (runtime/spec): with scheduler.batch_invariant (the default) the
    decode gears, one row per verified token; without it, the small prefill gears of export.buckets.verify_tokens.
    Also the most drafts one sequence can send (K+1 logits rows in one gear)."""
    prefill = manifest.families[PREFILL].gears
    small = sorted(manifest.export_config.get("export", {}).get("buckets", {}).get("verify_tokens") or [])
    return {"verify_tokens": small, "gears": len([g for g in prefill if g.tokens in small]),
            "max_num_speculative_tokens": max(g.seqs for g in prefill) - 1,
            "k_at_b1_in_decode_gears": max(g.seqs for g in manifest.families[DECODE].gears) - 1,
            "k_at_b1_in_smallest_gear": min(g.tokens for g in prefill) - 1}


def describe(artifact: Path, verify: bool = True) -> dict[str, Any]:
    """The artifact as one JSON-able record; `verify` recomputes every file's sha256 against the manifest."""
    manifest = Manifest.load(artifact, verify=False)
    files = {}
    for rel, digest in manifest.files.items():
        path = artifact / rel
        entry: dict[str, Any] = {"bytes": path.stat().st_size if path.is_file() else None, "sha256": digest}
        if verify:
            entry["ok"] = path.is_file() and file_sha256(path) == digest
        files[rel] = entry
    model = manifest.model
    return {
        "artifact": str(artifact),
        "model": {"architecture": model.architecture, "layers": model.num_layers, "hidden_size": model.hidden_size,
                  "heads": model.num_heads, "kv_heads": model.num_kv_heads, "head_dim": model.head_dim,
                  "vocab_size": model.vocab_size, "tie_word_embeddings": model.tie_word_embeddings,
                  "moe": None if model.moe is None else asdict(model.moe),
                  "source": manifest.export_config.get("model", {}).get("source")},
        "task": manifest.task,
        "pooling": None if model.pooling is None else asdict(model.pooling),
        "head": head_summary(model),
        "dtype": manifest.dtype,
        "block_size": manifest.block_size,
        "max_model_len": manifest.max_model_len,
        "families": {name: {"graph": spec.graph, "gears": len(spec.gears), "summary": family_summary(name, spec.gears),
                            "gear_list": [[g.tokens, g.seqs, g.blocks] for g in spec.gears]}
                     for name, spec in manifest.families.items()},
        "ladder_plan": manifest.ladder_plan,
        "speculation": speculation(manifest),
        "tensor_parallel": {"size": manifest.tensor_parallel_size, "ranks": [
            {**asdict(rank), "bytes": sum(f["bytes"] or 0 for rel, f in files.items()
                                          if rel.startswith(rank.folder + "/"))} for rank in manifest.ranks]},
        "generation_defaults": manifest.generation_defaults,
        "export_config": manifest.export_config,
        "versions": {"format": manifest.format_version, "op_set": manifest.op_set_version, **manifest.exported_with},
        "files": files,
        "total_bytes": sum(f["bytes"] or 0 for f in files.values()),
    }


def text(record: dict[str, Any], gears: bool = False) -> str:
    """The record for a terminal: a few lines per section; every gear only with `gears`."""
    m = record["model"]
    lines = [f"artifact      {record['artifact']}",
             f"model         {m['architecture']}: {m['layers']} layers, hidden {m['hidden_size']}, "
             f"{m['heads']}/{m['kv_heads']} heads of {m['head_dim']}, vocab {m['vocab_size']}"
             f"{', tied embeddings' if m['tie_word_embeddings'] else ''}; from {m['source']}",
             f"task          {record['head']}",
             *([f"experts       {e['num_experts']} per sparse layer ({len(e['sparse_layers'])} of {m['layers']}), "
                f"top-{e['top_k']}{' renormalized' if e['norm_topk_prob'] else ''}, {e['intermediate_size']} wide"]
               if (e := m.get("moe")) else []),
             f"dtype         {record['dtype']}, block_size {record['block_size']}, "
             f"max_model_len {record['max_model_len']}"]
    tp = record.get("tensor_parallel", {"size": 1, "ranks": []})
    for name, family in record["families"].items():
        where = family["graph"] if tp["size"] == 1 else f"{family['graph'].rpartition('/')[2]} of each rank"
        lines.append(f"buckets       {family['summary']} ({where})")
        if gears:
            lines += [f"                {name} T={t} B={b} M={mb}" for t, b, mb in family["gear_list"]]
    plan = record.get("ladder_plan")
    lines.append("ladder plan   " + (
        f"fitted to {plan['trace']} ({plan['requests']} requests, {plan['prompt_tokens']:,} prompt + "
        f"{plan['completion_tokens']:,} completion tokens): expected padding waste {plan['expected_padding_waste']:.3f} "
        f"(the ladders before: {plan['padding_waste_before']:.3f}), "
        + ", ".join(f"{n} {family} gears" for family, n in plan["gears"].items())
        if plan else "none: hand-picked ladders (`pagedgraph plan --trace` fits them to traffic)"))
    spec = record["speculation"]
    small = ", ".join(f"T={t}" for t in spec["verify_tokens"]) or "none (export.buckets.verify_tokens)"
    if record["task"] == "generate":  # an embedding artifact generates nothing to speculate on
        lines.append(f"speculation   verified as decode rows in the decode gears (K up to "
                     f"{spec['k_at_b1_in_decode_gears']} at B=1); with scheduler.batch_invariant false, in prefill "
                     f"gears {small}; num_speculative_tokens at most {spec['max_num_speculative_tokens']} (K+1 logits "
                     f"rows), {spec['k_at_b1_in_smallest_gear']} at B=1 in the smallest prefill gear")
    if tp["size"] > 1:
        lines.append(f"tensor        parallel over {tp['size']} ranks (graphs and weights per rank; embedding, LM head "
                     "and norms replicated)")
        lines += [f"                rank {r['rank']}: heads {r['heads'][0]}-{r['heads'][1] - 1}, KV heads "
                  f"{r['kv_heads'][0]}-{r['kv_heads'][1] - 1}, intermediate {r['intermediate'][0]}-"
                  f"{r['intermediate'][1] - 1}; {r['folder']} {r['bytes'] / 1e6:.1f} MB" for r in tp["ranks"]]
    defaults = record["generation_defaults"]
    lines.append("sampling      " + ("; ".join(f"{k} {v['value']} (from {v['source']})" for k, v in defaults.items())
                                     or "no generation defaults in the checkpoint: SamplingParams' own apply"))
    options = record["export_config"].get("export", {})
    lines.append("export        " + ", ".join(f"{k} {json.dumps(v)}" for k, v in options.items() if k != "buckets"))
    lines.append("versions      " + ", ".join(f"{k} {v}" for k, v in record["versions"].items()))
    checked = [f.get("ok") for f in record["files"].values()]
    state = ("verified: all match" if all(checked) else
             f"MISMATCH in {', '.join(r for r, f in record['files'].items() if f.get('ok') is False)}"
             ) if checked and checked[0] is not None else "not verified"
    lines.append(f"files         {len(record['files'])} + {MANIFEST}, {record['total_bytes'] / 1e6:.1f} MB; "
                 f"sha256 {state}")
    for rel, f in record["files"].items():
        size = "missing" if f["bytes"] is None else f"{f['bytes'] / 1e6:10.2f} MB"
        lines.append(f"                {rel:32} {size}  sha256 {f['sha256'][:16]}")
    return "\n".join(lines)
