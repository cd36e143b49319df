"""Prompt lookup (n-gram) drafting: no model. The last n tokens of a sequence are looked up among
its earlier tokens (prompt and output); the tokens that followed the most recent earlier match are
the draft. Cheap and strong when the answer repeats the prompt (code editing, extraction, RAG)."""

from __future__ import annotations


def ngram_draft(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest suffix of
    `tokens` (n from max_n down to min_n); [] when no suffix recurs."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        # Most recent first: the latest context is the likeliest to continue the same way.
        for start in range(size - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                if follow:
                    return follow
    return []
