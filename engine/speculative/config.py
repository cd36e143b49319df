"""Speculative decoding's settings, validated once (EngineArgs builds one; every entry point shares it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

METHODS = ("ngram", "draft", "self")
# vLLM's name for a method, where it has one; layerstream's own name stays accepted.
METHOD_ALIASES = {"draft_model": "draft"}
# The keys of vLLM's speculative_config that layerstream reads (adaptive_k is its own); anything else is refused.
CONFIG_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "adaptive_k")
MAX_SPECULATIVE_TOKENS = 16  # more drafts per pass than this only widen the verify pass for nothing


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's SpeculativeConfig, the part layerstream has (field names are vLLM's keys but adaptive_k).
    method: ngram (prompt lookup, no model), draft (vLLM's draft_model: a separate resident model with
    the same tokenizer, `model`), self (layerstream's own: the target with every streamed block, on the
    CPU every block, replaced by a resident int4 copy; embeddings shared). num_speculative_tokens: the
    most tokens a sequence drafts per pass (K); adaptive_k: each sequence's k follows its acceptance
    (adaptive.DraftLength), False keeps k = K."""

    method: str
    num_speculative_tokens: int = 4
    model: str | None = None  # the draft model (method "draft")
    prompt_lookup_min: int = 1  # n-gram sizes tried, longest first (method "ngram")
    prompt_lookup_max: int = 4
    adaptive_k: bool = True

    def __post_init__(self) -> None:
        method = METHOD_ALIASES.get(self.method, self.method) if isinstance(self.method, str) else self.method
        if method not in METHODS:
            raise ValueError(f"speculative method must be one of ngram, draft_model (or draft), self, "
                             f"got {self.method!r}")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"the speculative draft model must be a path or hub id, got {self.model!r}")
        if self.method == "draft" and not self.model:
            raise ValueError("speculative method 'draft' needs --speculative-model (speculative_config key 'model'): "
                             "a model with the same tokenizer")
        if self.method != "draft" and self.model:
            raise ValueError(f"a draft model (--speculative-model, speculative_config key 'model') is only used by "
                             f"method 'draft', not {self.method!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup n-gram sizes must satisfy 1 <= min <= max, got min "
                             f"{self.prompt_lookup_min}, max {self.prompt_lookup_max}")
        if not isinstance(self.adaptive_k, bool):
            raise ValueError(f"adaptive_k must be true or false, got {self.adaptive_k!r}")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> SpeculativeConfig:
        """From vLLM's speculative_config: keys CONFIG_KEYS, the ones left out at their defaults. With no
        method, a model means draft_model, and the model "ngram" (or "[ngram]") the ngram method, as in vLLM."""
        unknown = [key for key in config if key not in CONFIG_KEYS]
        if unknown:
            raise ValueError(f"speculative_config key {unknown[0]!r} is not supported: layerstream reads "
                             f"{', '.join(CONFIG_KEYS)}")
        kw = dict(config)
        if kw.get("method") is None:
            model = kw.get("model")
            if model is None:
                raise ValueError("speculative_config needs a 'method' (ngram, draft_model, self) or a draft 'model', "
                                 f"got {dict(config)!r}")
            kw["method"] = "ngram" if model in ("ngram", "[ngram]") else "draft"
            if kw["method"] == "ngram":
                kw["model"] = None
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The speculative_config dict that from_dict reads back into this config."""
        return dataclasses.asdict(self)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is no token count
