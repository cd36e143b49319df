"""Checkpoint formats: the readers of each on-disk format, and a block's tensors by short name over any of them.

Internal to engine/weights: only engine.weights itself imports these modules (engine/weights/__init__.py is
the interface).
"""
