"""Speculative decoding (engine.speculative): draft sources, verification, and the engine around them.

Exactness is checked against the same engine without speculation: greedy tokens, logprobs, finish
reasons and text must be identical, with penalties, logit_bias, stop strings and max_tokens, while
sequences join and leave the batch. The rejection sampler is checked statistically: a chi-square
test of the tokens it emits, over many seeds, against the target model's own probabilities.
"""

from __future__ import annotations

import pytest
import torch

from engine.args import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.speculative import Draft, DraftLength, ngram_draft, rejection_sample, verify_greedy
from tests.support.batching import MAX_LEN, PROMPTS, Result, drive

REPETITIVE = [5, 6, 7, 8, 9, 10, 11, 5, 6, 7, 8]  # the answer is in the prompt: n-gram lookup drafts it


# -- the pieces ----------------------------------------------------------------------------------

def test_ngram_draft_takes_the_longest_most_recent_match():
    assert ngram_draft([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    # Suffix [9, 1, 2] occurs once: its continuation wins over the later match of the shorter [1, 2].
    assert ngram_draft([9, 1, 2, 7, 1, 2, 8, 9, 1, 2], k=2) == [7, 1]
    assert ngram_draft([1, 2, 3, 4, 1, 2, 5, 1, 2], k=2, max_n=2) == [5, 1]  # most recent [1, 2]
    assert ngram_draft([1, 2, 3], k=4) == []  # nothing recurs
    assert ngram_draft([4, 4, 4], k=4, min_n=2) == [4]  # only one token followed the match
    assert ngram_draft([7], k=4) == []


def test_verify_greedy_stops_at_the_first_mismatch():
    assert verify_greedy([3, 4, 9, 6], [3, 4, 5]) == (2, 9)
    assert verify_greedy([3, 4, 5, 6], [3, 4, 5]) == (3, 6)  # all accepted: the bonus token
    assert verify_greedy([1, 2], [7]) == (0, 1)


def test_draft_length_grows_after_full_acceptance_and_shrinks_after_a_rejection():
    rule = DraftLength(4)
    assert rule.initial() == 4
    assert rule.next(4, drafted=4, accepted=2) == 3
    assert rule.next(1, drafted=1, accepted=0) == 1  # never below 1
    assert rule.next(2, drafted=2, accepted=2) == 4
    assert rule.next(3, drafted=3, accepted=3) == 4  # never above K
    assert rule.next(3, drafted=2, accepted=2) == 4  # a cut draft that held counts as held
    assert rule.next(3, drafted=0, accepted=0) == 3  # nothing proposed: nothing learned
    fixed = DraftLength(4, adaptive=False)
    assert fixed.next(4, drafted=4, accepted=0) == 4
    with pytest.raises(ValueError, match="must be >= 1"):
        DraftLength(0)


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed counts against expected probabilities (bins with expected < 5
    merged into one), the p-value from the chi-square survival function."""
    n = counts.sum()
    expected = probs * n
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)]) if small.any() else expected
    keep = exp > 0
    obs, exp = obs[keep].double(), exp[keep].double()
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.fixture(scope="module")
def two_models(model_dirs):
    """(target, draft) next-token distributions of two different tiny models with the same
    tokenizer, at temperature 1 restricted to top-4, for every context the 2-token test visits."""
    target = LLM(str(model_dirs["llama"]), max_model_len=64, max_num_seqs=1)
    draft = LLM(str(model_dirs["qwen2"]), max_model_len=64, max_num_seqs=1)
    params = SamplingParams(temperature=1.0, top_k=4)
    from engine.sampler import distribution

    cache: dict = {}

    def dist(which: str, ctx: tuple[int, ...]) -> torch.Tensor:
        key = (which, ctx)
        if key not in cache:
            llm = target if which == "target" else draft
            cache[key] = distribution(llm.engine.prompt_logits(list(ctx)), params)
        return cache[key]

    yield dist
    target.close()
    draft.close()


def _two_tokens(dist, prompt: tuple[int, ...], g: torch.Generator, sampler) -> tuple[int, int]:
    """Two tokens the way the engine makes them with k = 2 drafts: the draft proposes d0 ~ q(.|x),
    d1 ~ q(.|x d0); one verify pass emits the accepted drafts and one more token; if only one
    token came out, the next step samples the second from the target."""
    q0 = dist("draft", prompt)
    d0 = int(torch.multinomial(q0, 1, generator=g))
    q1 = dist("draft", prompt + (d0,))
    d1 = int(torch.multinomial(q1, 1, generator=g))
    p = torch.stack([dist("target", prompt), dist("target", prompt + (d0,)), dist("target", prompt + (d0, d1))])
    accepted, nxt = sampler(p, [d0, d1], torch.stack([q0, q1]), g)
    out = [d0, d1][:accepted] + [nxt]
    if len(out) == 1:
        out.append(int(torch.multinomial(dist("target", prompt + (out[0],)), 1, generator=g)))
    return out[0], out[1]


def _joint_test(dist, sampler, n: int = 3000) -> float:
    prompt = (5, 17, 33)
    p0 = dist("target", prompt)
    support = torch.nonzero(p0).flatten().tolist()
    cells = {}
    for a in support:
        pa = dist("target", prompt + (a,))
        for b in torch.nonzero(pa).flatten().tolist():
            cells[(a, b)] = float(p0[a] * pa[b])
    index = {c: i for i, c in enumerate(cells)}
    counts = torch.zeros(len(cells))
    for seed in range(n):
        pair = _two_tokens(dist, prompt, torch.Generator().manual_seed(seed), sampler)
        if pair not in index:
            return 0.0  # a pair the target never produces: rejected outright
        counts[index[pair]] += 1
    return chi_square_p_value(counts, torch.tensor(list(cells.values())))


def test_rejection_sampling_preserves_the_target_distribution(two_models):
    """Over 3000 seeds the first two tokens follow p(a) p(b | a) of the target model, although
    both were proposed by a different model: the chi-square test does not reject (p > 0.001)."""
    assert _joint_test(two_models, rejection_sample) > 1e-3


def test_the_chi_square_test_rejects_a_sampler_that_keeps_the_drafts(two_models):
    """The same test fails a sampler that accepts every draft (it samples the draft model)."""
    def keep_drafts(p, draft, q, g):
        return len(draft), int(torch.multinomial(p[-1], 1, generator=g))

    assert _joint_test(two_models, keep_drafts) < 1e-6


# -- the engine ----------------------------------------------------------------------------------

def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, **kw)


METHODS = {
    "ngram": dict(speculative_method="ngram"),
    "draft": dict(speculative_method="draft"),  # speculative_model: the qwen2 tiny model (same tokenizer)
    "self": dict(speculative_method="self"),
}


def spec_llm(model_dirs, method: str, **kw) -> LLM:
    extra = dict(METHODS[method])
    if method == "draft":
        extra["speculative_model"] = str(model_dirs["qwen2"])
    args = dict(max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=32) | extra | kw
    return LLM(str(model_dirs["llama"]), **args)


@pytest.fixture(scope="module")
def plain(model_dirs):
    """The reference: the same batch through the same engine without speculation."""
    llm = LLM(str(model_dirs["llama"]), max_model_len=MAX_LEN, max_num_seqs=4, max_num_batched_tokens=32)
    cache: dict = {}

    def run(arrivals) -> dict[str, Result]:
        key = repr(arrivals)
        if key not in cache:
            cache[key] = drive(llm.engine, arrivals)
        return cache[key]

    yield run
    llm.close()


def assert_same(got: dict[str, Result], want: dict[str, Result]) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert got[rid].tokens == want[rid].tokens, rid
        torch.testing.assert_close(torch.tensor(got[rid].logprobs), torch.tensor(want[rid].logprobs),
                                   atol=1e-4, rtol=1e-4)
        assert got[rid].finish_reason == want[rid].finish_reason


def _arrivals():
    params = {"a": greedy(20), "b": greedy(12), "c": greedy(24), "d": greedy(7)}
    # Three now, two later (one repetitive): sequences join and leave the batch while others speculate.
    return {0: [(rid, PROMPTS[rid], params[rid]) for rid in ("a", "b", "c")],
            3: [("d", PROMPTS["d"], params["d"]), ("r", REPETITIVE, greedy(30))]}


@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_with_speculation_is_greedy_without_it(model_dirs, plain, method):
    llm = spec_llm(model_dirs, method)
    try:
        got = drive(llm.engine, _arrivals())
        t = llm.telemetry().speculative
    finally:
        llm.close()
    assert_same(got, plain(_arrivals()))
    assert t.method == method and t.verify_passes > 0 and 0 < t.accepted_tokens <= t.draft_tokens
    # Every verify pass emits its accepted drafts plus one token (some may be cut by max_tokens).
    assert t.emitted_tokens == t.accepted_tokens + t.verify_passes
    assert sum(t.accepted_per_position) == t.accepted_tokens
    assert t.draft_seconds > 0 and t.verify_seconds > 0
    # Fewer engine steps than tokens: several tokens arrived in one step.
    assert max(len(r.tokens) - len(set(r.steps)) for r in got.values()) > 0


class OracleDrafter:
    """Proposes the reference's own next tokens once a sequence has `right_from` output tokens, and
    a wrong first token before: a draft source whose acceptance is known exactly. Records each k asked."""

    def __init__(self, want: dict[str, Result], right_from: int):
        self.want, self.right_from, self.asked = want, right_from, []

    def propose(self, requests):
        drafts = []
        for r in requests:
            n = len(r.seq.output_ids)
            self.asked.append(r.k)
            tokens = self.want[r.seq.request_id].tokens[n:n + r.k]
            if n < self.right_from:
                tokens = [(tokens[0] + 1) % 100] + tokens[1:]
            drafts.append(Draft(tokens, None))
        return drafts

    def close(self) -> None:
        pass


@pytest.mark.parametrize("adaptive, asked", [
    # 7 passes of wrong drafts (k 4, 3, 2, 1, ...), then right ones (k 1 -> 3 -> 4 -> 4, the last cut by max_tokens).
    (True, [4, 3, 2, 1, 1, 1, 1, 1, 3, 4, 4]),
    (False, [4] * 10),  # 7 wrong passes, then 3 right ones: out 8 -> 13 -> 18 -> 23; the last token alone
])
def test_k_adapts_to_each_sequence_acceptance_and_outputs_stay_exact(model_dirs, plain, adaptive, asked):
    arrivals = {0: [("x", PROMPTS["c"], greedy(24))]}
    want = plain(arrivals)
    llm = spec_llm(model_dirs, "ngram", speculative_adaptive_k=adaptive, max_num_batched_tokens=64)
    oracle = llm.engine.speculative.drafter = OracleDrafter(want, right_from=8)
    try:
        got = drive(llm.engine, arrivals)
        t = llm.telemetry().speculative
    finally:
        llm.close()
    assert_same(got, want)
    assert oracle.asked == asked
    assert t.adaptive_k is adaptive and t.draft_tokens == sum(asked) and t.mean_drafted == sum(asked) / len(asked)


def test_self_draft_with_streamed_blocks_is_exact_and_budgeted(model_dirs, plain):
    """Under a budget that streams blocks, the self-draft's int4 copies are in the plan (and its
    description): on the CPU one of every block, the resident one included (the draft then
    computes no 16-bit block); the output is still greedy's."""
    from engine.arch import load_model_config
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(model_dirs["llama"], load_model_config(model_dirs["llama"]))
    copy, head = checkpoint.self_draft_sizes(torch.float32)
    checkpoint.close()
    probe = spec_llm(model_dirs, "self")
    p = probe.plan
    probe.close()
    assert p.draft_bytes == head + 5 * copy  # a copy of every block
    # One resident block, four streamed; an int4 copy of all five and the int8 head.
    budget = (p.global_bytes + p.kv_cache_bytes + p.workspace_bytes + p.block_bytes
              + (p.prefetch_depth + 1) * p.block_bytes + head + 5 * copy + copy // 2)
    llm = spec_llm(model_dirs, "self", max_device_memory=budget)
    try:
        plan = llm.plan
        assert len(plan.streamed_blocks) == 4 and plan.draft_bytes == head + 5 * copy
        assert plan.device_bytes <= budget and "self-draft: int4 copies of every block" in plan.describe()
        got = drive(llm.engine, _arrivals())
        assert llm.telemetry().speculative.accepted_tokens > 0
    finally:
        llm.close()
    assert_same(got, plain(_arrivals()))


@pytest.mark.parametrize("method", ["draft", "self"])
def test_speculation_on_a_full_kv_pool_with_preemption_and_prefix_hits(model_dirs, plain, method):
    """A KV pool of one max_model_len sequence (8 blocks) for five growing sequences sharing a
    prefix: drafted positions take blocks only when free, preempted sequences come back (the draft
    model's own K/V is recomputed), prefix-cache hits skip work; outputs stay greedy's and the block
    accounting stays consistent after every step."""
    probe = spec_llm(model_dirs, method)
    block = probe.plan.kv_cache_bytes // probe.plan.num_kv_blocks
    probe.close()
    llm = spec_llm(model_dirs, method, kv_cache_memory=8 * block)
    try:
        assert llm.plan.num_kv_blocks == 8
        got = drive(llm.engine, _shared_prefix_arrivals(), on_step=lambda _s, e: e.scheduler.blocks.check())
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.telemetry().speculative.accepted_tokens > 0
        assert llm.engine.scheduler.blocks.stats.hit_tokens > 0
    finally:
        llm.close()
    assert_same(got, plain(_shared_prefix_arrivals()))


def _shared_prefix_arrivals():
    prefix = PROMPTS["d"]
    return {0: [(f"s{i}", prefix[:20 + 6 * i] + [i + 1] * 5, greedy(24 - 3 * i)) for i in range(3)],
            2: [("r", REPETITIVE, greedy(30))],
            20: [("late", prefix[:33] + [2], greedy(10))]}


@pytest.mark.parametrize("method", ["ngram", "self"])
def test_penalties_bias_stop_strings_and_max_tokens_behave_the_same(model_dirs, method):
    plain = LLM(str(model_dirs["llama"]), max_model_len=MAX_LEN)
    spec = spec_llm(model_dirs, method)
    base = plain.generate([REPETITIVE], greedy(16))[0].outputs[0]
    stop = base.text[len(base.text) // 2:len(base.text) // 2 + 2]  # a stop string met mid-output
    cases = [
        greedy(16, repetition_penalty=1.3),
        greedy(16, presence_penalty=1.5, frequency_penalty=0.7),
        greedy(16, logit_bias={base.token_ids[3]: -100.0, 12: 5.0}),
        greedy(16, stop=[stop]),
        greedy(5),
        SamplingParams(max_tokens=16, temperature=0.0, logprobs=2),  # with EOS
    ]
    try:
        for params in cases:
            want = plain.generate([REPETITIVE, PROMPTS["c"]], params)
            got = spec.generate([REPETITIVE, PROMPTS["c"]], params)
            for w, g in zip(want, got):
                w, g = w.outputs[0], g.outputs[0]
                assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason), params
                assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
        assert spec.telemetry().speculative.accepted_tokens > 0
    finally:
        plain.close()
        spec.close()


def test_seeded_sampling_with_speculation_is_reproducible(model_dirs):
    spec = spec_llm(model_dirs, "draft")
    try:
        params = SamplingParams(max_tokens=20, temperature=0.8, seed=7)
        a = spec.generate([PROMPTS["c"]], params)[0].outputs[0].token_ids
        b = spec.generate([PROMPTS["c"]], params)[0].outputs[0].token_ids
    finally:
        spec.close()
    assert a == b and len(a) == 20


@pytest.mark.parametrize("kw, message", [
    (dict(speculative_method="medusa"), "speculative method must be one of"),
    (dict(speculative_method="ngram", num_speculative_tokens=0), "num_speculative_tokens must be in"),
    (dict(speculative_method="ngram", num_speculative_tokens=17), "num_speculative_tokens must be in"),
    (dict(speculative_method="draft"), "needs --speculative-model"),
    (dict(speculative_model="x"), "needs --speculative-method draft"),
    (dict(speculative_method="ngram", speculative_model="x"), "only used by method 'draft'"),
    (dict(speculative_method="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "1 <= min <= max"),
    (dict(speculative_method="self", quantization="int4"), "unquantized target"),
])
def test_bad_speculative_settings_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="demo", **kw)


def test_a_draft_model_with_another_tokenizer_is_refused(model_dirs, tmp_path):
    from tests.support.models import build

    other = build(tmp_path / "other", "llama", tokenizer_vocab=300)
    with pytest.raises(ValueError, match="does not use the target's tokenizer"):
        LLM(str(model_dirs["llama"]), max_model_len=MAX_LEN, speculative_method="draft", speculative_model=str(other))


def test_self_draft_needs_a_16_bit_target(model_dirs, tmp_path):
    """A GGUF model's blocks already are low-bit: their int4 copies would cost what keeping them resident does."""
    from tests.support.gguf_models import write_gguf

    path = write_gguf(model_dirs["llama"], tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="needs a 16/32-bit safetensors target"):
        LLM(str(path), max_model_len=MAX_LEN, speculative_method="self")


def test_server_streams_several_tokens_per_event_and_reports_acceptance(llama_dir, tmp_path):
    """`layerstream serve --speculative-method ngram`: SSE text (completions and chat) equals the
    non-streamed text and plain greedy decoding's; some events carry several tokens (and their
    logprobs); /metrics has the acceptance figures and draft vs verify time."""
    from tests.support.server import start_server, stop_server

    prompt = "Hello world! Hello world! Hello world! Hello"
    ref = LLM(str(llama_dir), max_model_len=256)
    try:
        want = ref.generate([prompt], greedy(40))[0].outputs[0].text
    finally:
        ref.close()
    server = start_server(tmp_path, "spec", ["--model", str(llama_dir), "--served-model-name", "tiny",
                                             "--max-model-len", "256", "--speculative-method", "ngram",
                                             "--num-speculative-tokens", "3"], {})
    try:
        client = server.client()
        body = dict(model="tiny", prompt=prompt, max_tokens=40, temperature=0, logprobs=0,
                    extra_body={"ignore_eos": True})
        whole = client.completions.create(**body).choices[0].text
        events = [c for c in client.completions.create(stream=True, **body) if c.choices]
        streamed = "".join(c.choices[0].text for c in events)
        per_event = [len(c.choices[0].logprobs.tokens) for c in events if c.choices[0].logprobs]
        assert streamed == whole == want
        assert sum(per_event) == 40 and max(per_event) > 1
        # Chat: the same, with per-token logprobs and the usage chunk counting every token.
        msgs = [{"role": "user", "content": prompt}]
        chat = dict(model="tiny", messages=msgs, max_tokens=40, temperature=0, logprobs=True,
                    extra_body={"ignore_eos": True})
        whole_chat = client.chat.completions.create(**chat).choices[0].message.content
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **chat))
        deltas = [c for c in chunks if c.choices]
        per_chunk = [len(c.choices[0].logprobs.content) for c in deltas if c.choices[0].logprobs]
        assert "".join(c.choices[0].delta.content or "" for c in deltas) == whole_chat
        assert sum(per_chunk) == 40 and max(per_chunk) > 1 and chunks[-1].usage.completion_tokens == 40
        assert server.metric("layerstream_spec_decode_accepted_tokens", model_name="tiny") > 0
        assert server.metric("layerstream_spec_decode_mean_draft_tokens", model_name="tiny") > 0
        assert server.metric("layerstream_spec_decode_seconds", model_name="tiny", phase="draft") > 0
        assert server.metric("layerstream_spec_decode_seconds", model_name="tiny", phase="verify") > 0
        assert server.metric("vllm:spec_decode_num_drafts", model_name="tiny") > 0
        assert server.metric("vllm:generation_tokens_total", model_name="tiny") == 160
    finally:
        stop_server(server)


def test_the_adaptive_k_flag_reaches_the_config():
    import argparse

    from engine.cli import add_engine_arguments, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    on = engine_args_from(p.parse_args(["--speculative-method", "ngram"])).speculative_config
    off = engine_args_from(p.parse_args(["--speculative-method", "ngram", "--no-speculative-adaptive-k"]))
    assert on.adaptive_k is True and off.speculative_config.adaptive_k is False
