"""The expert-granular tier: routed experts streamed one by one into a fixed expert cache.

Internal to engine/weights: only engine.weights itself imports these modules (engine/weights/__init__.py is
the interface).
"""
