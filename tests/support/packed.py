"""Comparing packed weights bit for bit, and the kinds of weight a streamed block hands the math."""

from __future__ import annotations

import torch


def same_weight(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return (a.shape == b.shape and a.layout == b.layout and torch.equal(a.codes, b.codes)
            and torch.equal(a.scales.view(torch.uint8), b.scales.view(torch.uint8)))


def streamed_kinds(llm) -> set[type]:
    """The kinds of the projection weights the first streamed block's matmuls get (acquired in order,
    as the runner does; the engine is idle between generate() calls)."""
    weights = llm.engine.model.weights
    streamed = llm.plan.streamed_blocks[0]
    for b in range(streamed + 1):
        w = weights.acquire(b)
        weights.release(b)
    weights.reset()  # the next step starts the cycle at the first streamed block again
    return {type(v) for k, v in w.items() if k.startswith("w")}
