"""Per-request sampling parameters, validated at construction (the names vLLM uses)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .structured_output import StructuredOutput

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: -100 bans a token, 100 forces it


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token (0 = only the chosen)
    n: int = 1
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured: "StructuredOutput | None" = None  # a grammar the output must follow

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", "must be in [0, 20]"),
            (self.n >= 1, "n", "must be at least 1"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidParameter(name, f"{name} {why}, got {getattr(self, name)!r}")
        for token, bias in (self.logit_bias or {}).items():
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidParameter("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} "
                                                     f"for token {token}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this request names must exist in the model's vocabulary."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidParameter(name, f"{name} names token ids outside the vocabulary [0, {vocab_size}): "
                                             f"{bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def per_choice(self) -> list["SamplingParams"]:
        """One single-choice SamplingParams per choice of an n > 1 request: each choice samples
        independently, and a fixed seed is offset per choice (seed + i), so choice i of a seeded
        request is reproducible. The offline API and the server both use this."""
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]


def normalize_prompts(prompts) -> list:
    """One prompt or a batch, as a list of prompts: a string, a list of strings, a list of token
    ids, or a list of token-id lists (what both the offline API and /v1/completions accept)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class InvalidParameter(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
