"""Structured output: a grammar (JSON schema, regex, a choice of strings, or a Lark grammar) decides
which tokens a sequence may sample next. Built on llguidance (no torch dependency; its matchers
drop the GIL while they compile or compute a mask).

What callers use:
- `StructuredOutput`: the request's constraint, plain frozen data carried in SamplingParams.
- `GrammarLimits`: what one request's grammar may cost (EngineArgs: --max-grammar-ms,
  --grammar-cache-memory), and `parser_limits()`, llguidance's own limits, set explicitly.
- `GrammarCompiler` (one per engine): `check(so)` compiles a constraint on the compile pool and
  computes its first mask (raises InvalidParameter naming the request field, GrammarTooCostly when
  it is over budget), `guide(so)` makes one sequence's `Guide`, `prefetch(guides)` starts the next
  token masks on the mask pool, `wait_any(guides, timeout)` waits for one of them.
- `Guide`: `allowed(timeout)` returns the admitted token ids (None if the mask is not ready in
  time; GrammarTooCostly if it cost more than the budget), `accept(token)` advances past a sampled
  token, `finished` / `stopped` say the grammar is complete and admits nothing but end-of-sequence.

Cost, and who pays it: grammar work runs on small pools sized to the cores (compiles, masks),
never on the engine thread, and the engine does not wait for a mask that is not ready: that sequence
keeps its logits and samples at a later step (llm_engine), the others go on. (Only a mask that
was cheap last time is waited for, up to a small fraction of the step: it is late because the
machine is busy, and the wait saves that sequence a step.) Each request may spend
`GrammarLimits.max_cpu_seconds` of CPU time compiling (its first mask included: that is where
llguidance's lazy lexer does most of its work) and as much on each later token (its parse and its
mask); over it, a 400 before any token, or an error finish for that request alone. Neither a
compile nor a mask can be interrupted inside llguidance, so a new constraint is compiled first by
the grammar probe (grammar_probe: a process of its own, killed at the budget or at the cache's
memory cap), and only then here; llguidance's own limits bound what a single mask can do before
its budget is checked.

Masks of a batch go to the pool as one task per pool thread (each hand-off costs a GIL round trip
on the engine thread), except those of sequences whose last mask was expensive: each of those is a
task of its own on a second pool, so its cost delays only itself and others as expensive. llguidance's `LLMatcher.consume_token` (the parse
of a sampled token) holds the GIL: while it runs every thread of the server waits. So only a parse
that was cheap last time runs that way, on the engine thread (in `accept`, which lets a complete
grammar end its sequence in the same step); every other parse runs on the mask pool through
llguidance's `LLExecutor`, which parses with the GIL released on a worker thread of its own (one
per pool thread), and costs its request's budget like a mask. A parse that held the GIL and turned
out expensive ends its request (`GrammarLimits.max_parse_seconds`): that stall happens once.

Memory: compiled grammars are cached in bytes, not entries (`GrammarLimits.cache_bytes`); each
entry's size is measured as malloc's in-use bytes grown while it compiled and computed its first
mask (glibc's mallinfo2; the RSS growth elsewhere), plus large growth seen during the later masks
of its expensive sequences (its lexer builds states lazily; cheap masks build few). The cache keeps
room for one more compile as large as its largest entry, so the cap bounds the process's growth
with a compile in flight. A sequence's matcher copy is freed with the sequence.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from .grammar_probe import GrammarProbe, serialized_tokenizer
from .sampling_params import InvalidParameter

Kind = Literal["json", "json_object", "regex", "choice", "grammar"]

# Compact JSON (no free whitespace between tokens), the way OpenAI's structured output prints it.
# With flexible whitespace a weak model can loop on spaces and newlines until max_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Refused constraints remembered (their error only), so sending one again costs no compile.
_REFUSED_KEPT = 256
# A sequence whose last mask cost more CPU time than this gets a pool task of its own, so a grammar
# that turns expensive delays only its own sequence; ordinary masks cost a small fraction of it.
_ALONE_SECONDS = 0.001
# Growth of malloc's in-use bytes during one later mask that is counted against the grammar's cache
# entry: smaller changes cannot be told from what other threads allocate meanwhile.
_COUNTED_GROWTH = 256 * 1024


class GrammarTooCostly(InvalidParameter):
    """A constraint that costs more than the server allows (CPU time, or memory): a 400 naming the
    request field before any token, or the error that ends its request if the cost shows later."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost. max_cpu_seconds: CPU time to compile (first mask
    included) and to follow each later token (its parse and its mask); max_parse_seconds: CPU time
    of one token's parse on the engine thread, which holds the GIL (llguidance's consume_token does
    not release it), so every thread of the server waits while it runs: past it the request ends
    (parses on the pool release the GIL and only count against max_cpu_seconds); cache_bytes:
    the compiled-grammar cache's size; threads: each pool's threads (0: sized to the cores);
    probe: compile each new grammar first in the grammar probe's process (off where the memory plan
    could not hold it: then a compile's cost is checked after the fact)."""

    max_cpu_seconds: float = 0.5
    max_parse_seconds: float = 0.01
    cache_bytes: int = 256 * 2**20
    threads: int = 0
    probe: bool = True

    def __post_init__(self) -> None:
        if not self.max_cpu_seconds > 0:
            raise ValueError(f"max_grammar_ms must be > 0, got {self.max_cpu_seconds * 1000:g}")
        if not self.max_parse_seconds > 0:
            raise ValueError(f"max_parse_seconds must be > 0, got {self.max_parse_seconds}")
        if self.cache_bytes < 1:
            raise ValueError(f"grammar_cache_memory must be > 0 bytes, got {self.cache_bytes}")
        if self.threads < 0:
            raise ValueError(f"grammar threads must be >= 0, got {self.threads}")

    @property
    def pool_threads(self) -> int:
        # A quarter of the cores, at most 8: on a CPU server the cores belong to the forward pass.
        # On a small machine that is one thread per pool; a second one there costs the forward
        # pass more than it saves (each hands the GIL back and forth). The masks of expensive
        # sequences have a pool of their own, so they never delay the cheap ones.
        return self.threads or max(1, min(8, (os.cpu_count() or 1) // 4))


# llguidance's limits, each set explicitly (its defaults unless said otherwise). The speeds quoted
# are llguidance's documentation's. They bound a single compile or mask, which cannot be
# interrupted in this process; GrammarLimits then decides what a request may spend.
PARSER_LIMITS = dict(
    # Fuel for building the lexer's regex expressions (~50k per ms; default 1M). With the
    # default, counted repetitions such as (q{20000}){20000} built hundreds of MB over a second
    # on their first mask; with this they run out a few tokens in (their request ends with an
    # error) after tens of MB.
    initial_lexer_fuel=200_000,
    # Lexer fuel of one mask (~14k per ms): bounds a mask's lexer work.
    step_lexer_fuel=200_000,
    # Earley items one mask may create (~20k per ms): bounds a mask's parser work. (The parse of
    # a sampled token is not bounded by it, but by max_items_in_row and the request's budget.)
    step_max_items=50_000,
    # Earley items in one row: beyond it the parse fails (too ambiguous, or right-recursive).
    max_items_in_row=2_000,
    # Lexer states, built lazily as masks walk the vocabulary, 1-2 kB each: bounds one grammar's
    # memory to about 100 MB (default 250k, about 0.5 GB).
    max_lexer_states=50_000,
    # Symbols in the grammar's productions: bounds a schema's size.
    max_grammar_size=500_000,
    # Large lexemes are run over the whole token trie at lexer build: a dearer compile (which
    # the budget bounds) for cheaper masks.
    precompute_large_lexemes=True,
    # Errors reach clients: no parser state dump (default True).
    verbose_errors=False,
)


def parser_limits():
    """PARSER_LIMITS as llguidance's LLParserLimits."""
    from llguidance import LLParserLimits

    return LLParserLimits(**PARSER_LIMITS)


@dataclass(frozen=True)
class StructuredOutput:
    """kind: json (spec = a JSON schema as text), json_object (any JSON object; spec unused), regex,
    choice (spec = a JSON list of strings), grammar (spec = a Lark grammar, llguidance's dialect).
    param: the request field it came from, named in errors."""

    kind: Kind
    spec: str = ""
    param: str = "response_format"
    # json: ignore the keywords llguidance does not implement (an unknown "format") instead of
    # refusing the schema. For schemas that are checked, not enforced (tool_choice auto).
    lenient: bool = False

    def grammar(self) -> str:
        """The llguidance grammar for this constraint (not yet checked against a tokenizer)."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json":
                return LLMatcher.grammar_from_json_schema(self.spec, defaults={**JSON_OPTIONS, "lenient": self.lenient})
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


def json_schema(schema: dict, param: str = "response_format", lenient: bool = False) -> StructuredOutput:
    if not isinstance(schema, dict):
        raise InvalidParameter(param, f"{param}: a JSON schema must be an object, got {type(schema).__name__}")
    return StructuredOutput("json", json.dumps(schema, sort_keys=True), param, lenient)


def choice(options: list[str], param: str = "guided_choice") -> StructuredOutput:
    if not options or not all(isinstance(o, str) and o for o in options):
        raise InvalidParameter(param, f"{param} must be a non-empty list of non-empty strings")
    return StructuredOutput("choice", json.dumps(options), param)


def _regex_escape(text: str) -> str:
    # llguidance's regex dialect is Rust's: escape every metacharacter it knows.
    return "".join("\\" + ch if ch in r"\.+*?()|[]{}^$#&-~" else ch for ch in text)


@dataclass
class MaskStats:
    """Totals over the engine's life: masks computed, seconds computing them (pool threads), seconds
    the engine thread waited for one (only when nothing else could run), CPU seconds of the token
    parses that held the GIL (on the engine thread: every thread waited meanwhile) and the longest
    of them, CPU seconds of the parses that released it (on the pool), sequences that skipped a
    step because their mask was late, requests refused or ended for their grammar's cost, and the
    compiled-grammar cache (bytes as estimated, entries); probe_bytes is read when the snapshot is
    taken (the grammar probe's resident memory)."""

    masks: int = 0
    compute_seconds: float = 0.0
    wait_seconds: float = 0.0
    gil_parse_seconds: float = 0.0
    gil_parse_longest: float = 0.0
    pool_parse_seconds: float = 0.0
    skips: int = 0
    over_budget: int = 0
    cache_bytes: int = 0
    cache_entries: int = 0
    probe_bytes: int = 0  # the grammar probe process's resident memory

    def snapshot(self) -> "MaskStats":
        return dataclasses.replace(self)


class _Entry:
    """A compiled constraint: its prototype matcher (sequences get copies, which share its lexer)
    and its estimated size."""

    __slots__ = ("matcher", "nbytes")

    def __init__(self, matcher, nbytes: int):
        self.matcher, self.nbytes = matcher, nbytes


class GrammarCompiler:
    """The engine's llguidance tokenizer (built on first use: about a second for a 50k vocabulary),
    the grammar pools and the cache of compiled constraints. `check` may run on any thread but the
    pools'; `guide`, `prefetch` and `wait_any` on the engine's."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits = GrammarLimits()):
        self._hf = hf_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = [t for t in eos_token_ids if t < vocab_size]
        self.limits = limits
        self._words = (vocab_size + 31) // 32  # int32 words of one mask
        self._lock = threading.Lock()
        self._tokenizer = None
        self._parser_limits = None
        self._probe: GrammarProbe | None = None
        self._cache: OrderedDict[StructuredOutput, _Entry] = OrderedDict()
        self._refused: OrderedDict[StructuredOutput, InvalidParameter] = OrderedDict()
        self._compiling: dict[StructuredOutput, Future] = {}  # one compile however many requests send it
        n = limits.pool_threads
        self._compile_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="layerstream-grammar-compile",
                                                initializer=_lower_priority)
        self._local = threading.local()  # a mask pool thread's _OffGilParser
        self._mask_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="layerstream-grammar-mask",
                                             initializer=self._init_mask_thread)
        # The masks of sequences whose last mask was expensive: queued behind each other, never
        # ahead of a cheap one (a hostile grammar delays only grammars as costly as itself). Its
        # threads start only when such a sequence exists.
        self._slow_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="layerstream-grammar-slow",
                                             initializer=self._init_mask_thread)
        self.stats = MaskStats()

    def _init_mask_thread(self) -> None:
        _lower_priority()  # before the executor's worker is made: it inherits this thread's priority
        self._local.parser = _OffGilParser()

    def _ll_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self.eos_token_ids or None)
                self._parser_limits = parser_limits()
                self._probe = self._make_probe()
            return self._tokenizer

    def _make_probe(self) -> "GrammarProbe | None":
        # The probe's child builds its own llguidance tokenizer from the same serialized fast
        # tokenizer that llguidance.hf.from_tokenizer reads (a slow tokenizer has none: no probe).
        tokenizer_json = serialized_tokenizer(self._hf) if self.limits.probe else None
        if tokenizer_json is None:
            return None
        return GrammarProbe(tokenizer_json, self.vocab_size, self.eos_token_ids, PARSER_LIMITS,
                            self.limits.max_cpu_seconds, self.limits.cache_bytes)

    # -- compiling --------------------------------------------------------------------------------
    def check(self, so: StructuredOutput):
        """Compile `so` once (cached) on the compile pool and return its prototype matcher.
        InvalidParameter naming so.param if it is not a valid grammar, GrammarTooCostly if it costs
        more than the limits allow; either is remembered, so resending it costs nothing."""
        with self._lock:
            entry = self._cache.get(so)
            if entry is not None:
                self._cache.move_to_end(so)
                return entry.matcher
            refused = self._refused.get(so)
            if refused is not None:
                raise type(refused)(refused.param, str(refused))
            pending = self._compiling.get(so)
            if pending is None:
                pending = self._compiling[so] = self._compile_pool.submit(self._compile, so)
        return pending.result().matcher

    def _compile(self, so: StructuredOutput) -> _Entry:
        # On a compile pool thread. CPU time, not wall time: a busy machine is not the request's fault.
        from llguidance import LLMatcher

        tok = self._ll_tokenizer()  # once per engine, not the request's cost
        cpu0, heap0 = time.thread_time(), _heap_bytes()
        try:
            grammar = so.grammar()
            self._probed(so, grammar)
            matcher = LLMatcher(tok, grammar, log_level=0, limits=self._parser_limits)
            if not matcher.is_error():
                # The first mask: where llguidance's lazy lexer shows what the grammar costs.
                scratch = torch.zeros(self._words, dtype=torch.int32)  # (vocab / 32,) one bit per token
                matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), self._words * 4)
            if matcher.is_error():
                raise InvalidParameter(so.param, f"{so.param} is not a valid constraint: "
                                                 f"{matcher.get_error().splitlines()[0]}")
            cpu = time.thread_time() - cpu0
            budget = self.limits.max_cpu_seconds
            if cpu > budget:
                raise GrammarTooCostly(so.param, f"{so.param}: compiling this constraint took {cpu * 1000:.0f} ms "
                                                 f"of CPU time, over this server's budget of {budget * 1000:.0f} ms "
                                                 "(--max-grammar-ms); simplify it")
            nbytes = max(_heap_bytes() - heap0, len(grammar))
            if nbytes > self.limits.cache_bytes:
                raise GrammarTooCostly(so.param, f"{so.param}: this constraint compiles to about {nbytes >> 20} MiB, "
                                                 "more than this server's grammar cache holds "
                                                 f"({self.limits.cache_bytes >> 20} MiB, --grammar-cache-memory)")
        except InvalidParameter as e:
            with self._lock:
                self._compiling.pop(so, None)
                self._refused[so] = e
                while len(self._refused) > _REFUSED_KEPT:
                    self._refused.popitem(last=False)
                if isinstance(e, GrammarTooCostly):
                    self.stats.over_budget += 1
            raise
        except BaseException:
            with self._lock:
                self._compiling.pop(so, None)
            raise
        entry = _Entry(matcher, nbytes)
        with self._lock:
            self._compiling.pop(so, None)
            self._cache[so] = entry
            self.stats.cache_bytes += nbytes
            freed = self._evict()
        _give_back(freed)  # outside the lock: the engine thread takes it for every guide
        return entry

    def _probed(self, so: StructuredOutput, grammar: str) -> None:
        """Compile `grammar` in the probe's process first, where its CPU time and memory are bounded
        as it runs (killed at the budget); raise what the server's compile would, without paying
        for it here. No probe (not Linux, or no process could start): the compile here is checked
        after the fact."""
        verdict = self._probe.probe(grammar) if self._probe is not None else None
        if verdict is None:
            return
        budget = self.limits.max_cpu_seconds
        if verdict.stopped == "memory":
            raise GrammarTooCostly(so.param, f"{so.param}: compiling this constraint needed more than "
                                             f"{self.limits.cache_bytes >> 20} MiB, more than this server's "
                                             "grammar cache holds (--grammar-cache-memory); simplify it")
        if verdict.stopped == "cpu" or verdict.cpu_seconds > budget:
            raise GrammarTooCostly(so.param, f"{so.param}: compiling this constraint took more than "
                                             f"{budget * 1000:.0f} ms of CPU time, this server's budget "
                                             "(--max-grammar-ms); it was stopped there. Simplify it")
        if verdict.error is not None:
            raise InvalidParameter(so.param, f"{so.param} is not a valid constraint: {verdict.error}")

    def _evict(self) -> int:
        """Under self._lock. Least recently used first, until the entries and room for one more as
        large as the largest of them fit the cap: the next compile's memory (its entry, and what it
        allocates and frees on the way, which malloc keeps for reuse) is inside the cap too, so the
        cap bounds what the grammars make the process hold, not only what the cache holds. A
        sequence following an evicted grammar keeps its matcher copy (and the lexer it shares) until
        it finishes. The bytes evicted."""
        freed = 0
        room = max((e.nbytes for e in self._cache.values()), default=0)
        while self.stats.cache_bytes + room > self.limits.cache_bytes and self._cache:
            _, old = self._cache.popitem(last=False)
            self.stats.cache_bytes -= old.nbytes
            freed += old.nbytes
        self.stats.cache_entries = len(self._cache)
        return freed

    def _grew(self, so: StructuredOutput, nbytes: int) -> None:
        freed = 0
        with self._lock:
            entry = self._cache.get(so)
            if entry is not None:
                entry.nbytes += nbytes
                self.stats.cache_bytes += nbytes
                freed = self._evict()
        _give_back(freed)

    # -- masks ------------------------------------------------------------------------------------
    def guide(self, so: StructuredOutput) -> "Guide":
        """A sequence's guide. Never compiles on the caller's thread (the engine's): a constraint
        not in the cache (the server compiled it, but it was evicted since; or an offline caller
        did not check it) is compiled with its first mask on the pools, and an invalid or too
        costly one then fails that sequence alone (allowed() raises)."""
        with self._lock:
            entry = self._cache.get(so)
            if entry is not None:
                self._cache.move_to_end(so)
        return Guide(entry.matcher.deep_copy() if entry is not None else None, so, self)

    def prefetch(self, guides: list["Guide"]) -> None:
        """Start computing the next token mask of every guide that has none pending: the cheap ones
        in one task per pool thread, each expensive one in a task of its own on the slow pool."""
        todo = [g for g in guides if g._pending is None]
        batch = [g for g in todo if g._last_cpu <= _ALONE_SECONDS]
        # The cheap ones spread over the pool's threads (one task on a small machine).
        n = min(len(batch), self.limits.pool_threads)
        tasks = [(self._mask_pool, batch[i::n]) for i in range(n)]
        tasks += [(self._slow_pool, [g]) for g in todo if g._last_cpu > _ALONE_SECONDS]
        for pool, task in tasks:
            pending = pool.submit(self._compute, task)
            for g in task:
                g._pending = pending

    def wait_any(self, guides: list["Guide"], timeout: float) -> None:
        """Wait until one of the guides' masks is ready, at most `timeout` seconds."""
        self._wait(guides, timeout, FIRST_COMPLETED)

    def wait_cheap(self, guides: list["Guide"], timeout: float) -> None:
        """Wait, at most `timeout` seconds, for the pending masks of the guides whose last mask was
        cheap: such a mask is late only because the machine is busy, and a short wait saves the
        sequence a step. An expensive one is never waited for."""
        self._wait([g for g in guides if g._last_cpu <= _ALONE_SECONDS], timeout, ALL_COMPLETED)

    def _wait(self, guides: list["Guide"], timeout: float, return_when: str) -> None:
        pending = {g._pending for g in guides if g._pending is not None and not g._pending.done()}
        if pending and timeout > 0:
            t0 = time.perf_counter()
            wait(pending, timeout, return_when=return_when)
            self.stats.wait_seconds += time.perf_counter() - t0

    def _compute(self, guides: list["Guide"]) -> None:
        # On a mask (or slow) pool thread: each guide parses the tokens its sequence sampled since
        # its last mask, if accept() left them (an expensive parse), then llguidance fills its row
        # with the GIL released; numpy turns the rows into each sequence's admitted token ids (torch's
        # shift-and-mask took 5x longer), which the sampler gathers.
        t0 = time.perf_counter()
        words = self._words
        bits = torch.zeros(len(guides), words, dtype=torch.int32)  # (guides, vocab / 32) one bit per token
        # Lexer growth is measured for an expensive guide (a task of its own) only: mallinfo2 walks
        # malloc's free lists, which in a large process costs as much as many cheap masks.
        measure = len(guides) == 1 and guides[0]._last_cpu > _ALONE_SECONDS
        for i, g in enumerate(guides):
            if g._matcher is None:  # compiled on the compile pool (this thread waits for it)
                try:
                    g._matcher = self.check(g._so).deep_copy()
                except InvalidParameter as e:  # counted by _compile if it was too costly
                    g._failure = e
                    continue
            heap0 = _heap_bytes() if measure else 0
            if g._tokens:
                g._parse(self._local.parser)
            cpu0 = time.thread_time()
            if g._failure is None and not g._matcher.is_stopped():
                was_error = g._matcher.is_error()
                g._matcher.unsafe_compute_mask_ptr(bits.data_ptr() + i * words * 4, words * 4)
                if not was_error and g._matcher.is_error():
                    g._limit_hit()
            g._last_cpu = time.thread_time() - cpu0 + g._last_parse  # the token's grammar work
            grown = _heap_bytes() - heap0 if measure else 0
            if grown >= _COUNTED_GROWTH:
                self._grew(g._so, grown)
        # Bit i of word w is token 32 * w + i (little-endian words and bit order).
        unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")  # (guides, words * 32)
        budget = self.limits.max_cpu_seconds
        for g, row in zip(guides, unpacked[:, : self.vocab_size]):
            if g._failure is None and g._last_cpu > budget:
                param = g._so.param
                g._costly(GrammarTooCostly(
                    param, f"{param}: the grammar work for one token of this constraint took "
                           f"{g._last_cpu * 1000:.0f} ms of CPU time, over this server's budget of "
                           f"{budget * 1000:.0f} ms (--max-grammar-ms); the request was ended"))
            if g._failure is not None:
                continue
            ids = np.flatnonzero(row)  # (admitted,) ascending
            # A matcher put in an error state by a refused token, or a complete grammar, admits
            # nothing; end its sequence rather than sample from nothing.
            g._allowed = torch.from_numpy(ids) if ids.size else torch.tensor(self.eos_token_ids, dtype=torch.long)
        with self._lock:
            self.stats.masks += len(guides)
            self.stats.compute_seconds += time.perf_counter() - t0

    def telemetry(self) -> MaskStats:
        with self._lock:
            stats = self.stats.snapshot()
        if self._probe is not None:
            stats.probe_bytes = self._probe.rss_bytes()
        return stats

    def close(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
        self._slow_pool.shutdown(wait=False, cancel_futures=True)
        if self._probe is not None:
            self._probe.close()


# The pools' threads run at a lower priority (Linux nice, per thread) so that grammar work takes
# the cores the forward pass leaves idle: an OpenMP region waits for its slowest thread, and a
# grammar thread holding one of its cores stretches the whole step. Relative to the thread that
# starts them (the engine's): an absolute nice would *raise* the pools above an engine started
# at a lower priority (as root may), and the grammar work would then take the forward pass's cores.
POOL_NICE_ABOVE_ENGINE = 10
_NICEST = 19


def _lower_priority() -> None:
    try:
        tid = threading.get_native_id()
        # A new thread starts at its creator's nice; getpriority reads this thread's own.
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(_NICEST, now + POOL_NICE_ABOVE_ENGINE))
    except (AttributeError, OSError):  # not Linux, or not permitted: same priority as the engine
        pass


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _load_mallinfo2():
    try:
        # CDLL: the GIL is released while mallinfo2 walks malloc's free lists (a fraction of a ms
        # in a process holding a model).
        fn = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None
    fn.restype = _MallInfo2
    return fn


_mallinfo2 = _load_mallinfo2()


def _load_malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim  # CDLL: the GIL is released while it runs
    except (OSError, AttributeError):  # not glibc
        return None


_malloc_trim = _load_malloc_trim()
# Evicted bytes worth handing back to the system: malloc keeps what the evicted lexers freed for
# reuse, so without a trim the process stays at its high-water mark and the cache's cap does not
# bound its memory.
_TRIM_AT = 8 << 20


def _give_back(freed: int) -> None:
    if freed >= _TRIM_AT and _malloc_trim is not None:
        _malloc_trim(0)


def _heap_bytes() -> int:
    """Bytes malloc has handed out and not taken back (process-wide; llguidance allocates through
    it), or the resident set size where glibc's mallinfo2 is missing (then memory freed and reused
    counts as none), or 0 where neither is known."""
    if _mallinfo2 is not None:
        info = _mallinfo2()
        return info.uordblks + info.hblkhd
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


_EXECUTOR_MADE = threading.Lock()  # one executor made at a time, so its worker can be told apart


class _OffGilParser:
    """A mask pool thread's way to parse sampled tokens without holding the GIL. llguidance's
    LLExecutor.consume_token_par parses a batch with the GIL released, on its own rayon pool (here
    one worker thread, made by and so as low in priority as this pool thread), but parses a batch
    of one holding the GIL: each call pairs the token with a no-op, a matcher that is already
    stopped being offered end-of-sequence. The parse's CPU time is read from the worker's own
    clock (Linux: a thread's CPU clock id from its tid); where the worker cannot be told apart,
    wall time stands in (an upper bound: a busy machine then ends an expensive request sooner)."""

    def __init__(self):
        from llguidance import LLExecutor

        with _EXECUTOR_MADE:
            before = _task_ids()
            self._executor = LLExecutor(num_threads=1)
            made = _task_ids() - before
        # Another thread of the process started meanwhile: the worker is one of them, unknown.
        self._clock = _thread_cpu_clock(made.pop()) if len(made) == 1 else None
        self._noop = None  # (a stopped matcher, its tokenizer's end-of-sequence id), made on first use

    def consume(self, matcher, token: int, compiler: "GrammarCompiler") -> float:
        """matcher.consume_token(token) with the GIL released; the worker's CPU seconds."""
        if self._noop is None:
            from llguidance import LLMatcher

            tok = compiler._ll_tokenizer()
            noop = LLMatcher(tok, LLMatcher.grammar_from_regex(""), log_level=0)
            noop.consume_token(tok.eos_token)
            assert noop.is_stopped(), "the no-op matcher must be stopped (it then accepts EOS for free)"
            self._noop = (noop, tok.eos_token)
        t0 = self._now()
        self._executor.consume_token_par([(matcher, token), self._noop])
        return self._now() - t0

    def _now(self) -> float:
        if self._clock is not None:
            try:
                return time.clock_gettime(self._clock)
            except OSError:  # the worker is gone (never, while the executor lives)
                self._clock = None
        return time.perf_counter()


def _task_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux
        return set()


def _thread_cpu_clock(tid: int) -> int | None:
    # Linux's clock id for a thread's CPU time (MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)), which
    # clock_gettime reads for any thread of this process.
    clock = ((~tid) << 3) | 6
    try:
        time.clock_gettime(clock)
    except OSError:
        return None
    return clock


class Guide:
    """One sequence's grammar state and its next-token mask. Masks run on the pool only; a sampled
    token is parsed by `accept` while its grammar's parses are cheap (holding the GIL, bounded by
    GrammarLimits.max_parse_seconds), else by the pool with the next mask, the GIL released.
    `stopped` and `error` are read once `allowed` returned."""

    def __init__(self, matcher, so: StructuredOutput, compiler: GrammarCompiler):
        self._matcher = matcher  # None until the pool has compiled `so` (GrammarCompiler.guide)
        self._so = so
        self._compiler = compiler
        self._tokens: list[int] = []  # accepted, not yet consumed by the matcher
        self._allowed: torch.Tensor | None = None  # (admitted,) int64 token ids, set by the pool
        self._pending: Future | None = None
        self._last_cpu = 0.0  # CPU seconds of the last token's parse + mask
        self._last_parse = 0.0  # CPU seconds of the last parse
        # Why this sequence must end with an error: its constraint is invalid (compiled late) or
        # grew too costly.
        self._failure: InvalidParameter | None = None

    def prefetch(self) -> None:
        """Start computing the mask for the next token (no-op when one is already pending)."""
        self._compiler.prefetch([self])

    @property
    def ready(self) -> bool:
        """The next mask is computed (allowed(timeout=0) will not return None)."""
        return self._pending is not None and self._pending.done()

    def allowed(self, timeout: float | None = None) -> torch.Tensor | None:
        """(admitted,) int64, ascending: the token ids the grammar admits next; None when the mask
        is not ready within `timeout` seconds (None: wait for it). Raises GrammarTooCostly when
        the grammar work for the token cost more CPU time than the budget, or hit a limit."""
        self.prefetch()
        try:
            self._pending.result(timeout)
        except TimeoutError:
            return None
        if self._failure is not None:
            raise self._failure
        return self._allowed

    def accept(self, token: int) -> None:
        """Advance past a sampled token. Parsed now if the last parse was cheap (here it holds the
        GIL, which a cheap parse costs less than a hand-off, and lets `finished` end the sequence
        at once), else by the pool with the next mask, the GIL released. The mask only admits valid
        tokens, so a refusal is a bug (or a stop token the grammar does not know), reported by
        `error`."""
        if self._pending is not None:
            self._pending.result()  # the matcher is the pool's until its mask is done
        self._pending = None
        self._tokens.append(token)
        if self._matcher is not None and self._failure is None and self._last_parse <= _ALONE_SECONDS:
            self._parse()

    @property
    def finished(self) -> bool:
        """The grammar is complete (known without waiting: False while a parse is left to the pool)."""
        return not self._tokens and self._failure is None and self._matcher is not None \
            and self._matcher.is_stopped()

    @property
    def failure(self) -> InvalidParameter | None:
        """Why this sequence must end with an error (known so far, without waiting), or None."""
        return self._failure

    def _parse(self, parser: "_OffGilParser | None" = None) -> None:
        # The sampled tokens: through the pool thread's parser (the GIL released, CPU time counted
        # with the token's mask against max_cpu_seconds), or on this thread holding the GIL, timed
        # against GrammarLimits.max_parse_seconds.
        if parser is not None:
            self._last_parse = parse = self._consume(parser)
            with self._compiler._lock:
                self._compiler.stats.pool_parse_seconds += parse
            return
        cpu0 = time.thread_time()
        self._consume()
        self._last_parse = parse = time.thread_time() - cpu0
        with self._compiler._lock:
            stats = self._compiler.stats
            stats.gil_parse_seconds += parse
            stats.gil_parse_longest = max(stats.gil_parse_longest, parse)
        limit = self._compiler.limits.max_parse_seconds
        if self._failure is None and parse > limit:
            param = self._so.param
            self._costly(GrammarTooCostly(
                param, f"{param}: parsing one token of this constraint took {parse * 1000:.1f} ms of CPU time "
                       f"while holding up every request, over this server's limit of {limit * 1000:.0f} ms; "
                       "the request was ended. Make the grammar unambiguous"))

    def _consume(self, parser: "_OffGilParser | None" = None) -> float:
        """Parse the sampled tokens; the CPU seconds the parser's worker spent (0 without one)."""
        tokens, self._tokens = self._tokens, []
        cpu = 0.0
        for token in tokens:
            was_error = self._matcher.is_error()
            if parser is None:
                self._matcher.consume_token(token)
            else:
                cpu += parser.consume(self._matcher, token, self._compiler)
            if not was_error and self._matcher.is_error() and self._allowed is not None \
                    and bool((self._allowed == token).any()):
                # A token its own mask admitted, refused: the lexer went past one of llguidance's
                # limits on the way.
                self._limit_hit()
        return cpu

    def _limit_hit(self) -> None:
        # The mask only admits valid tokens, so an error while following one is one of llguidance's
        # limits (parser_limits): the grammar grew too costly to follow.
        param = self._so.param
        self._costly(GrammarTooCostly(
            param, f"{param}: this constraint went past the grammar engine's limits while generating "
                   f"({self._matcher.get_error().splitlines()[0]}); the request was ended"))

    def _costly(self, error: GrammarTooCostly) -> None:
        self._failure = error
        with self._compiler._lock:
            self._compiler.stats.over_budget += 1

    def _settled(self):
        if self._pending is None and self._matcher is None:
            self.prefetch()
        if self._pending is not None:
            self._pending.result()
        elif self._tokens:
            self._consume()
        if self._matcher is None:
            raise self._failure
        return self._matcher

    @property
    def stopped(self) -> bool:
        """The grammar is complete and admits nothing more (or failed): the sequence should end."""
        return self._settled().is_stopped()

    @property
    def error(self) -> str:
        return self._settled().get_error()
