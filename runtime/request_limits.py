"""Caps on what one request may ask for; past one, the request is refused naming the field and the cap.

Every stop string is checked on every token and every logit_bias entry and stop token id is applied on every
step, so their number is bounded, as is the size of a schema (compiled into a grammar) and the tool count. Each
cap lies above what clients send: OpenAI accepts 4 stop strings, 300 logit_bias entries, 128 tools and schemas
of up to 5,000 properties; vLLM's GPU sampler holds 128 stop token ids and 1,024 logit_bias entries a request.
"""
from __future__ import annotations

MAX_STOP = 64  # stop strings per request
MAX_STOP_CHARS = 512  # characters per stop string
MAX_STOP_TOKEN_IDS = 128
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_TOOLS = 128
MAX_SCHEMA_CHARS = 1 << 18  # a JSON schema, regex, grammar or choice list, as JSON text; each function's parameters

