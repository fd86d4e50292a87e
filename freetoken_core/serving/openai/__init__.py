"""The OpenAI-compatible frontend: an ASGI app that speaks to the ensemble over tritonclient's gRPC streaming."""
