"""How many tokens a sequence drafts next, from how its last draft fared (no torch: a pure rule).

The rule (transformers' "heuristic" schedule for assisted generation, per sequence): k starts at
its most, K = --num-speculative-tokens; after a verify pass that accepted every drafted token, k
grows by 2 (at most K); after one that rejected a draft, k shrinks by 1 (at least 1). With a
per-token acceptance a, k settles where a full acceptance (a^k) is about a third of the passes
(2 a^k = 1 - a^k): k ~ 10 at a = 0.9 (so K), 3 at a = 0.7, 1 at a <= 0.35. A sequence whose drafts keep failing stops
paying for k rows of verification and k draft steps it does not get back; one whose drafts hold
returns to K within a few passes. --no-speculative-adaptive-k keeps k = K for every pass.
"""

from __future__ import annotations

from dataclasses import dataclass

GROW = 2  # after a pass that accepted every draft
SHRINK = 1  # after a pass that rejected one


@dataclass(frozen=True)
class DraftLength:
    """max_k: K; adaptive: False keeps k = K."""

    max_k: int
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"the most tokens drafted per pass must be >= 1, got {self.max_k}")

    def initial(self) -> int:
        return self.max_k

    def next(self, k: int, drafted: int, accepted: int) -> int:
        """k after a verify pass that checked `drafted` tokens (k or fewer: a draft may be cut by
        max_tokens, the context or the step's budget, or a source may find fewer) and accepted
        `accepted` of them."""
        assert 0 <= accepted <= drafted
        if not self.adaptive or drafted == 0:
            return k
        if accepted == drafted:
            return min(self.max_k, k + GROW)
        return max(1, k - SHRINK)
