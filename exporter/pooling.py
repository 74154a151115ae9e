"""An embedding export's pooling head (export.task: embed), resolved as vLLM resolves its pooler: each key of
export.pooling as the YAML sets it, else what the checkpoint says (its sentence-transformers modules: the Pooling
module's mode, a Normalize module; config.json's Matryoshka fields), else vLLM's defaults for a decoder used as an
embedder (the last token, normalised, no truncation)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..artifact.settings import ConfigError
from ..graphs.config import ModelConfig, Pooling
from .config import PoolingOptions

# sentence-transformers' Pooling modes the pooling head computes, by its config.json key
MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
NORMALIZE = "sentence_transformers.models.Normalize"
POOLING = "sentence_transformers.models.Pooling"


def pooling_head(source: Path, options: PoolingOptions) -> Pooling:
    """The head of an embedding export of checkpoint `source` (a directory, or a GGUF file, which says none of this).
    The sentence-transformers modules are read only where export.pooling.type is left out."""
    modules = _json(source / "modules.json") if source.is_dir() and options.type is None else None
    mode, normalize = _sentence_transformers(source, modules) if isinstance(modules, list) else (None, None)
    hf = (_json(source / "config.json") or {}) if source.is_dir() else {}
    listed = options.matryoshka_dimensions or hf.get("matryoshka_dimensions") or ()
    matryoshka = options.matryoshka if options.matryoshka is not None else (
        bool(options.matryoshka_dimensions) or bool(hf.get("is_matryoshka")) or bool(listed))
    return Pooling(type=options.type or mode or "last",
                   normalize=next(v for v in (options.normalize, normalize, True) if v is not None),
                   matryoshka=matryoshka, matryoshka_dimensions=tuple(sorted(set(listed))) if matryoshka else ())


def check_pooling(config: ModelConfig) -> None:
    """The Matryoshka dimensions against the model's hidden size."""
    dims = config.pooling.matryoshka_dimensions if config.pooling is not None else ()
    if dims and max(dims) > config.hidden_size:
        raise ConfigError(f"export.pooling.matryoshka_dimensions = {list(dims)}: the model's "
                          f"vectors have {config.hidden_size} dimensions; list none above it")


def _sentence_transformers(root: Path, modules: list[Any]) -> tuple[str | None, bool]:
    """The pooling mode of a sentence-transformers checkpoint's Pooling module (None: it has none), and whether a
    Normalize module follows; a module the head does not compute is refused."""
    kinds = [m.get("type") for m in modules if isinstance(m, dict)]
    others = [k for k in kinds[1:] if k not in (POOLING, NORMALIZE)]
    if others:
        raise ConfigError(f"{root / 'modules.json'}: sentence-transformers modules {others} follow the transformer; "
                          "the pooling head computes Pooling and Normalize only, so the vectors would differ (set "
                          "export.pooling.type to export the head without them anyway)")
    pooling = next((m for m in modules if isinstance(m, dict) and m.get("type") == POOLING), None)
    if pooling is None:
        return None, NORMALIZE in kinds
    path = root / str(pooling.get("path", "")) / "config.json"
    config = _json(path) or {}
    modes = [key for key, on in config.items() if key.startswith("pooling_mode_") and on is True]
    if len(modes) != 1 or modes[0] not in MODES:
        raise ConfigError(f"{path}: pooling modes {modes}; the pooling head computes one of {sorted(MODES)} "
                          "(set export.pooling.type to last or mean to choose)")
    if config.get("include_prompt") is False:
        raise ConfigError(f"{path}: include_prompt false leaves the instruction out of the pooled tokens, which the "
                          "pooling head does not do (set export.pooling.type to choose a head anyway)")
    return MODES[modes[0]], NORMALIZE in kinds


def _json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc})") from None
