"""Building the configured draft source for a loaded target model."""

from __future__ import annotations

from ..kv_cache import KVCache
from ..runner import ModelRunner
from .config import SpeculativeConfig
from .drafter import Drafter, ModelDrafter, NgramDrafter


def build_drafter(config: SpeculativeConfig, target, draft_model=None) -> Drafter:
    """target: the engine's LoadedModel; draft_model: the LoadedModel of method "draft" (owned from here)."""
    if config.method == "ngram":
        return NgramDrafter(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "self":
        weights = target.weights.self_draft()
        return ModelDrafter(ModelRunner(target.cfg, weights, target.runner.kv, target.runner.device, target.dtype,
                                        attn_chunk_bytes=target.plan.attn_chunk_bytes), shares_kv=True)
    assert draft_model is not None
    # The draft's pool mirrors the target's blocks, so each sequence's block table serves both.
    d, plan = draft_model.cfg, target.plan
    heads, k_width, v_width = d.kv_cache_dims
    kv = KVCache(d.num_layers, plan.num_kv_blocks, plan.kv_block_size, heads, k_width, draft_model.dtype,
                 target.runner.device, v_head_dim=v_width)
    return ModelDrafter(ModelRunner(d, draft_model.weights, kv, target.runner.device, draft_model.dtype,
                                    attn_chunk_bytes=draft_model.plan.attn_chunk_bytes),
                        shares_kv=False, owner=draft_model)


__all__ = ["build_drafter"]
