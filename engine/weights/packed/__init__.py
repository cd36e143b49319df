"""Packed weights: the packed weight types, what a GGUF tensor becomes for compute, quantization at load, and the
cache entries (quantized, prepacked) they are written to once.

Internal to engine/weights: only engine.weights itself imports these modules (engine/weights/__init__.py is
the interface).
"""
