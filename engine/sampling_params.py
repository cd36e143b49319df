"""Per-request sampling parameters, validated at construction (the names vLLM uses).

`RANGES` is the one table of what each numeric field accepts: SamplingParams checks it for every
entry point (offline API, CLI, server), and the server's request models put the same bounds in
their OpenAPI schema. The ranges are OpenAI's documented ones where OpenAI has the field; the
lower bounds of the others keep the arithmetic finite (a tiny repetition penalty divides logits).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .structured_output import StructuredOutput

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: -100 bans a token, 100 forces it

# Temperatures below this sample greedily, as vLLM's _SAMPLING_EPS: dividing logits by 1e-30
# overflows fp32 to inf, and softmax of inf is NaN.
SAMPLING_EPS = 1e-5

# Completions' `logprobs` and chat's `top_logprobs`: OpenAI allows 5 and 20; we allow 20 for both.
MAX_LOGPROBS = 20

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts

# name -> (lowest, highest), both inclusive; None = unbounded on that side.
RANGES: dict[str, tuple[float | None, float | None]] = {
    "max_tokens": (1, None),
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 100.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
    "n": (1, None),
    "seed": (SEED_MIN, SEED_MAX),
}


def check_range(name: str, value) -> None:
    """InvalidParameter naming `name` unless value is a finite number inside RANGES[name]."""
    lo, hi = RANGES[name]
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidParameter(name, f"{name} must be a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidParameter(name, f"{name} must be {where}, got {value!r}")


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice `index` of a request (n > 1): seed + index, wrapped inside the 64-bit
    range so a seed near the top does not overflow the generator."""
    if seed is None:
        return None
    return (seed - SEED_MIN + index) % (SEED_MAX - SEED_MIN + 1) + SEED_MIN


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
    prompt_logprobs: int | None = None  # the same for every prompt token (the first has none); vLLM's name
    n: int = 1
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    structured: "StructuredOutput | None" = None  # a grammar the output must follow
    skip_special_tokens: bool = True  # special tokens left out of the text (vLLM's name)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        for name in RANGES:
            value = getattr(self, name)
            if value is not None:
                check_range(name, value)
        if not (self.top_k == -1 or self.top_k >= 1):
            raise InvalidParameter("top_k", f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
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
        return self.temperature < SAMPLING_EPS

    def per_choice(self) -> list["SamplingParams"]:
        """One single-choice SamplingParams per choice of an n > 1 request: each choice samples
        independently, and a fixed seed is offset per choice (seed + i), so choice i of a seeded
        request is reproducible. The offline API and the server both use this."""
        return [dataclasses.replace(self, n=1, seed=choice_seed(self.seed, i))
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
