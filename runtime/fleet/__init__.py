"""Data parallelism on one host or several: `pagedgraph serve` replicas behind vllm-router (docs/scale-out.md)."""
