"""The OpenAI-compatible HTTP server: one engine loop thread shared by all requests (see docs/server.md)."""
