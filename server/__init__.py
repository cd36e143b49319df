"""OpenAI-compatible HTTP server over the layerstream engine."""
