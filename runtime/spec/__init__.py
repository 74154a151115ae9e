"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), verification of K+1 tokens per sequence
in one packed step, and rejection sampling that keeps the target distribution."""
