"""Structured output: a grammar (JSON schema, regex, a choice of strings, or a Lark grammar) decides
which tokens a sequence may sample next. Built on llguidance (no torch dependency; its matchers
drop the GIL while they compute a mask).

What callers use:
- `StructuredOutput`: the request's constraint, plain frozen data carried in SamplingParams.
- `GrammarCompiler` (one per engine): `check(so)` compiles and validates a constraint (raises
  InvalidParameter naming the request field), `guide(so)` makes one sequence's `Guide`.
- `Guide`: `prefetch()` starts computing the next token mask on a worker thread, `allowed()` waits
  for it and returns a (vocab,) bool tensor, `accept(token)` advances the grammar, `stopped` says
  the grammar is complete and admits nothing but end-of-sequence.

Timing: the engine calls `prefetch()` right after it samples a sequence's token, so the mask for
the next step is computed while the next forward pass runs; `allowed()` only waits when the mask
took longer than the forward pass. `MaskStats` records both, for /metrics and the benchmark.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import torch

from .sampling_params import InvalidParameter

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]

# Compact JSON (no free whitespace between tokens), the way OpenAI's structured output prints it.
# With flexible whitespace a weak model can loop on spaces and newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 64  # compiled prototypes kept per engine (a matcher copy is cheap, compiling is not)


@dataclass(frozen=True)
class StructuredOutput:
    """kind: json (spec = a JSON schema as text), json_object (any JSON object; spec unused), regex,
    choice (spec = a JSON list of strings), grammar (spec = a Lark grammar, llguidance's dialect).
    param: the request field it came from, named in errors."""

    kind: Kind
    spec: str = ""
    param: str = "response_format"

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (not yet checked against a tokenizer)."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json":
                return LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.spec)
            if self.kind == "choice":
                choices = json.loads(self.spec)
                return LLMatcher.grammar_from_regex("|".join(_regex_escape(c) for c in choices))
            if self.kind == "grammar":
                return LLMatcher.grammar_from_lark(self.spec)
        except ValueError as e:
            raise InvalidParameter(self.param, f"{self.param}: {e}") from e
        raise InvalidParameter(self.param, f"unknown structured output kind {self.kind!r}")


def json_schema(schema: dict, param: str = "response_format") -> StructuredOutput:
    if not isinstance(schema, dict):
        raise InvalidParameter(param, f"{param}: a JSON schema must be an object, got {type(schema).__name__}")
    return StructuredOutput("json", json.dumps(schema, sort_keys=True), param)


def choice(options: list[str], param: str = "guided_choice") -> StructuredOutput:
    if not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidParameter(param, f"{param} must be a non-empty list of non-empty strings")
    return StructuredOutput("choice", json.dumps(options), param)


def _regex_escape(text: str) -> str:
    # llguidance's regex dialect is Rust's: escape every metacharacter it knows.
    return "".join("\\" + ch if ch in r"\.+*?()|[]{}^$#&-~" else ch for ch in text)


@dataclass
class MaskStats:
    """Totals over the engine's life: masks computed, seconds computing them (worker thread) and
    seconds the engine thread waited for one before sampling (the part on the critical path)."""

    masks: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0

    def snapshot(self) -> "MaskStats":
        return MaskStats(self.masks, self.compute_seconds, self.wait_seconds)


class GrammarCompiler:
    """The engine's llguidance tokenizer (built on first use: about a second for a 50k vocabulary)
    and a cache of compiled constraints. `check` may run on any thread; `guide` on the engine's."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self._lock = threading.Lock()
        self._tokenizer = None
        self._prototypes: OrderedDict[StructuredOutput, object] = OrderedDict()
        # One worker: on a small CPU a second would only compete with the forward pass.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-grammar")
        self.stats = MaskStats()

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_ids or None)
        return self._tokenizer

    def check(self, so: StructuredOutput):
        """Compile `so` once (cached); InvalidParameter naming so.param if it is not a valid grammar."""
        from llguidance import LLMatcher

        with self._lock:
            proto = self._prototypes.get(so)
            if proto is not None:
                self._prototypes.move_to_end(so)
                return proto
            tok = self._ll_tokenizer()
        grammar = so.grammar()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise InvalidParameter(so.param, f"{so.param} is not a valid constraint: {messages[0]}")
        proto = LLMatcher(tok, grammar, log_level=0)
        if proto.is_error():
            raise InvalidParameter(so.param, f"{so.param} is not a valid constraint: {proto.get_error()}")
        with self._lock:
            self._prototypes[so] = proto
            while len(self._prototypes) > _CACHE_SIZE:
                self._prototypes.popitem(last=False)
        return proto

    def guide(self, so: StructuredOutput) -> "Guide":
        return Guide(self.check(so).deep_copy(), self)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Guide:
    """One sequence's grammar state and its next-token mask."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        self._matcher = matcher
        self._compiler = compiler
        words = (compiler.vocab_size + 31) // 32
        self._bits = torch.zeros(words, dtype=torch.int32)  # (vocab / 32,) one bit per token
        self._pending: Future | None = None

    def _compute(self) -> None:
        t0 = time.perf_counter()
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        stats = self._compiler.stats
        stats.masks += 1
        stats.compute_seconds += time.perf_counter() - t0

    def prefetch(self) -> None:
        """Start computing the mask for the next token (no-op when one is already pending)."""
        if self._pending is None:
            self._pending = self._compiler._pool.submit(self._compute)

    def allowed(self) -> torch.Tensor:
        """(vocab,) bool: the tokens the grammar admits next. Waits for the prefetched mask."""
        self.prefetch()
        t0 = time.perf_counter()
        self._pending.result()
        self._compiler.stats.wait_seconds += time.perf_counter() - t0
        shifts = torch.arange(32, dtype=torch.int32)
        bits = (self._bits[:, None] >> shifts) & 1  # (vocab / 32, 32)
        allowed = bits.reshape(-1)[: self._compiler.vocab_size].bool()
        if not allowed.any():
            # A matcher in an error state admits nothing; end the sequence rather than sample
            # from an all -inf row (NaN probabilities would fail the whole step).
            allowed[self._compiler.eos_token_ids] = True
        return allowed

    def accept(self, token: int) -> None:
        """Advance past a sampled token. The mask only admits valid tokens, so a refusal is a bug
        (or a stop token the grammar does not know), reported by `error`."""
        self._pending = None
        self._matcher.consume_token(token)

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more (or failed): the sequence should end."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str:
        return self._matcher.get_error()
