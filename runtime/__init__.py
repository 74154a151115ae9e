"""The compiled-graph runner: paged KV cache, packer, scheduler, executors, sampling, server."""
from runtime.engine import LLM, LLMEngine, RequestOutput
from runtime.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
