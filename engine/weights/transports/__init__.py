"""Transports: how a streamed block's weights reach compute (page cache, disk, CUDA, simulated link), which
transport serves which tier, and the prefetch thread that drives them.

Internal to engine/weights: only engine.weights itself imports these modules (engine/weights/__init__.py is
the interface).
"""
