"""Verification of one sequence's draft from the target's logits at its k + 1 verified positions."""

from __future__ import annotations

import torch

from ..sampler import argmax, distribution, processed_logits
from ..sampling_params import SamplingParams
from .drafter import Draft
from .rejection import rejection_sample, verify_greedy


def verify(rows: torch.Tensor, draft: Draft, params: SamplingParams, prompt_ids: list[int], output_ids: list[int],
           generator: torch.Generator) -> tuple[int, int]:
    """rows: (k + 1, vocab) fp32 raw target logits, row i after the sequence and the first i drafts.
    -> (drafts accepted, the token after them). Row i is processed (penalties, logit_bias) with the
    output as it would be after the first i drafts: that row is only used if they were accepted, so
    each token sees exactly what non-speculative decoding would have shown it."""
    k = len(draft.tokens)
    processed = [processed_logits(rows[i], params, prompt_ids, output_ids + draft.tokens[:i]) for i in range(k + 1)]
    if params.greedy:
        return verify_greedy([argmax(p) for p in processed], draft.tokens)
    dists = []
    for p in processed:
        d = distribution(p, params)
        if d is None:  # non-finite logits: the most likely token, as sample_one does
            d = torch.zeros_like(p)
            d[argmax(p)] = 1.0
        dists.append(d)
    q = draft.probs
    if q is not None and q.shape[-1] != rows.shape[-1]:
        # A draft model's vocabulary may be padded differently: the target's ids are what count
        # (a draft token outside them was dropped before verification).
        v = rows.shape[-1]
        q = q[:, :v] if q.shape[-1] > v else torch.nn.functional.pad(q, (0, v - q.shape[-1]))
    return rejection_sample(torch.stack(dists), draft.tokens, q, generator)
