"""Speculative decoding's settings, validated once (EngineArgs builds one; every entry point shares it)."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft", "self")
MAX_SPECULATIVE_TOKENS = 16  # more drafts per pass than this only widen the verify pass for nothing


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: ngram (prompt lookup, no model), draft (a separate resident model with the same
    tokenizer, `model`), self (the target with every streamed block, on the CPU every block,
    replaced by a resident int4 copy; embeddings shared). num_speculative_tokens: the most tokens a
    sequence drafts per pass (K); adaptive_k: each sequence's k follows its acceptance
    (adaptive.DraftLength), False keeps k = K."""

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model (method "draft")
    prompt_lookup_min: int = 1  # n-gram sizes tried, longest first (method "ngram")
    prompt_lookup_max: int = 4
    adaptive_k: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs --speculative-model (a model with the same tokenizer)")
        if self.method != "draft" and self.model:
            raise ValueError(f"--speculative-model is only used by method 'draft', not {self.method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup n-gram sizes must satisfy 1 <= min <= max, got min "
                             f"{self.prompt_lookup_min}, max {self.prompt_lookup_max}")
