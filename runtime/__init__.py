"""The compiled-graph runner: paged KV cache, packer, scheduler, executors, sampling, server."""
from .engine import LLM, LLMEngine, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
