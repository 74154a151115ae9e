"""An embedding artifact's vectors -> the bodies of /v1/embeddings (OpenAI's shape) and of vLLM's /v1/score and
/v1/rerank, whose scores are the cosine similarities of the texts' vectors (vLLM's bi-encoder scoring)."""
from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Sequence

import numpy as np

from ..engine import RequestOutput


def _envelope(prefix: str, model: str, outs: Sequence[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(out.prompt_token_ids) for out in outs)
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "usage": {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}}


def encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a JSON array; base64: the float32 little-endian bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return vector.tolist()


def embedding_response(model: str, outs: Sequence[RequestOutput], encoding_format: str) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": encoded(_vector(out), encoding_format)}
            for i, out in enumerate(outs)]
    return {**_envelope("embd", model, outs), "data": data}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The cosine similarity of two vectors (their dot product when normalised)."""
    norms = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    return float(np.dot(a, b)) / max(norms, 1e-12)


def score_response(model: str, outs: Sequence[RequestOutput], pairs: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """vLLM's /score answer: one score per pair of texts (indices into `outs`)."""
    data = [{"object": "score", "index": i, "score": cosine(_vector(outs[a]), _vector(outs[b]))}
            for i, (a, b) in enumerate(pairs)]
    return {**_envelope("score", model, outs), "data": data}


def rerank_response(model: str, documents: Sequence[str], outs: Sequence[RequestOutput], top_n: int,
                    return_documents: bool) -> dict[str, Any]:
    """vLLM's /rerank answer: the documents (`outs[1:]`) by similarity to the query (`outs[0]`), best first, the
    best `top_n` (0: all)."""
    query = _vector(outs[0])
    scored = sorted(((cosine(query, _vector(out)), i) for i, out in enumerate(outs[1:])), key=lambda s: -s[0])
    results = [{"index": i, "relevance_score": score, **({"document": {"text": documents[i]}} if return_documents
                                                         else {})}
               for score, i in scored[:top_n or len(scored)]]
    envelope = _envelope("rerank", model, outs)
    return {"id": envelope["id"], "model": model, "usage": {"total_tokens": envelope["usage"]["total_tokens"]},
            "results": results}


def _vector(out: RequestOutput) -> np.ndarray:
    assert out.embedding is not None, f"{out.request_id} finished without an embedding"
    return out.embedding
