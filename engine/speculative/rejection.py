"""Verification of drafted tokens against the target model's distributions.

Greedy: a draft token is accepted while it is the target's argmax; the first mismatch is replaced
by the target's argmax (so the output is exactly greedy decoding's). Sampling: speculative
(rejection) sampling (Leviathan et al. 2023; Chen et al. 2023), which emits tokens distributed
exactly as sampling from the target would: draft token x drafted with probability q(x) is accepted
with probability min(1, p(x) / q(x)); at the first rejection the token is drawn from the residual
max(p - q, 0) renormalised; when every draft is accepted one more token is drawn from the target's
next distribution (the bonus token). A draft without probabilities (n-gram lookup) is a
deterministic proposal: q is one-hot on the drafted token.
"""

from __future__ import annotations

import torch

from ..sampler import draw


def verify_greedy(target_argmax: list[int], draft: list[int]) -> tuple[int, int]:
    """target_argmax: k + 1 target tokens, one per verified position. -> (drafts accepted, next token)."""
    assert len(target_argmax) == len(draft) + 1
    for i, d in enumerate(draft):
        if target_argmax[i] != d:
            return i, target_argmax[i]
    return len(draft), target_argmax[len(draft)]


def _categorical(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A draw from probs (vocab,), which need not be normalised (a residual is not)."""
    token = draw(probs, generator)
    assert token is not None, "non-finite probabilities"
    return token


def rejection_sample(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
                     generator: torch.Generator) -> tuple[int, int]:
    """target_probs: (k + 1, vocab) fp32, row i the target's (processed) distribution after the
    first i drafts; draft: k token ids; draft_probs: (k, vocab) the distributions they were drawn
    from, or None for a deterministic draft. -> (drafts accepted, next token)."""
    k = len(draft)
    assert target_probs.shape[0] == k + 1 and (draft_probs is None or draft_probs.shape[0] == k)
    for i, x in enumerate(draft):
        p = float(target_probs[i, x])
        q = 1.0 if draft_probs is None else float(draft_probs[i, x])
        u = float(torch.rand((), generator=generator))
        # u < p / q, written without the division: q > 0 since x was drawn from it (or q = 1).
        if u * q < p:
            continue
        if draft_probs is None:
            residual = target_probs[i].clone()
            residual[x] = 0.0
        else:
            residual = (target_probs[i] - draft_probs[i]).clamp_(min=0.0)
        if float(residual.sum()) <= 0.0:
            # p <= q everywhere means p == q (both sum to 1): a rejection then has probability 0, so
            # only rounding lands here; p itself is the right distribution.
            residual = target_probs[i]
        return i, _categorical(residual, generator)
    return k, _categorical(target_probs[k], generator)
