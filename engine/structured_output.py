"""Structured output: a grammar (JSON schema, regex, a choice of strings, or a Lark grammar) decides
which tokens a sequence may sample next. Built on llguidance (no torch dependency; its matchers
drop the GIL while they compute a mask).

What callers use:
- `StructuredOutput`: the request's constraint, plain frozen data carried in SamplingParams.
- `GrammarCompiler` (one per engine): `check(so)` compiles and validates a constraint (raises
  InvalidParameter naming the request field), `guide(so)` makes one sequence's `Guide`.
  `prefetch(guides)` starts computing the next token masks of a batch of sequences on the worker.
- `Guide`: `allowed()` waits for its mask and returns the admitted token ids, `accept(token)`
  advances the grammar, `stopped` says the grammar is complete and admits nothing but
  end-of-sequence.

Timing: the engine calls `prefetch(guides)` once per step, after it sampled the step's tokens, so
the masks for the next step are computed while the next forward pass runs; `allowed()` only waits
when they took longer than the pass. One task per step, not one per sequence: each hand-off to the
worker costs a GIL round trip on the engine thread (measured at ~1 ms each on a loaded 2-core
machine, which at batch 16 cost more than the masks). `MaskStats` records the compute time and the
waits, for /metrics and the benchmark.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

import numpy as np
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
        self._executor = None  # llguidance's LLExecutor, made on the worker
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

    def prefetch(self, guides: list["Guide"]) -> None:
        """Start computing the next token mask of every guide that has none pending, in one
        task on the worker (masks of one batch are computed together)."""
        todo = [g for g in guides if g._pending is None]
        if todo:
            pending = self._pool.submit(self._compute, todo)
            for g in todo:
                g._pending = pending

    def _compute(self, guides: list["Guide"]) -> None:
        # On the worker. llguidance fills the batch's bitmask with the GIL released (0.1-0.4 ms
        # for 16 JSON-schema masks over a 49k vocabulary); numpy turns it into each sequence's
        # admitted token ids (torch's shift-and-mask took 5x longer), which the sampler gathers.
        t0 = time.perf_counter()
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor(num_threads=_executor_threads())
        words = (self.vocab_size + 31) // 32
        bits = torch.zeros(len(guides), words, dtype=torch.int32)  # (guides, vocab / 32) one bit per token
        self._executor.unsafe_compute_mask_ptr([(g._matcher, i) for i, g in enumerate(guides)],
                                               bits.data_ptr(), words * 4, len(guides))
        # Bit i of word w is token 32 * w + i (little-endian words and bit order).
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")  # (guides, words * 32)
        for g, row in zip(guides, unpacked[:, : self.vocab_size]):
            ids = np.flatnonzero(row)  # (admitted,) ascending
            # A matcher in an error state admits nothing; end its sequence rather than sample
            # from nothing.
            g._allowed = torch.from_numpy(ids) if ids.size else torch.tensor(self.eos_token_ids, dtype=torch.long)
        self.stats.masks += len(guides)
        self.stats.compute_seconds += time.perf_counter() - t0

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _executor_threads() -> int:
    # Mask work is a few ms per batch-16 step; on a small CPU more threads would only take cores
    # from the forward pass, on a large one a few spread a big batch.
    return max(1, min(4, (os.cpu_count() or 1) // 8))


class Guide:
    """One sequence's grammar state and its next-token mask."""

    def __init__(self, matcher, compiler: GrammarCompiler):
        self._matcher = matcher
        self._compiler = compiler
        self._allowed: torch.Tensor | None = None  # (admitted,) int64 token ids, set by the worker
        self._pending: Future | None = None

    def prefetch(self) -> None:
        """Start computing the mask for the next token (no-op when one is already pending)."""
        self._compiler.prefetch([self])

    def allowed(self) -> torch.Tensor:
        """(admitted,) int64, ascending: the token ids the grammar admits next. Waits for the prefetched mask."""
        self.prefetch()
        t0 = time.perf_counter()
        self._pending.result()
        self._compiler.stats.wait_seconds += time.perf_counter() - t0
        return self._allowed

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
