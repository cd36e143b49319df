"""Sampling against transformers' own logits processors, plus seeds, stops and logprobs end to end."""

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from engine import LLM, SamplingParams
from engine.sampler import apply_penalties, filter_logits, make_generator, sample_one
from engine.sampling_params import InvalidParameter

VOCAB = 50


@pytest.fixture
def logits():
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def hf(processor, logits, ids=None):
    ids = torch.tensor([ids or [0]])
    return processor(ids, logits[None].clone())[0]


@pytest.mark.parametrize("params,processor", [
    (SamplingParams(temperature=0.7, top_k=5), lambda: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]),
    (SamplingParams(temperature=1.3, top_p=0.8), lambda: [TemperatureLogitsWarper(1.3), TopPLogitsWarper(0.8)]),
    (SamplingParams(temperature=1.0, min_p=0.1), lambda: [MinPLogitsWarper(0.1)]),
])
def test_filters_match_transformers(logits, params, processor):
    expected = logits.clone()
    for p in processor():
        expected = hf(p, expected)
    ours = filter_logits(logits.clone(), params)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    torch.testing.assert_close(ours[~torch.isinf(ours)], expected[~torch.isinf(expected)])


def test_repetition_penalty_matches_transformers(logits):
    prompt, output = [1, 2, 3], [3, 7, 7]
    ours = apply_penalties(logits.clone(), SamplingParams(repetition_penalty=1.5), prompt, output)
    expected = hf(RepetitionPenaltyLogitsProcessor(1.5), logits, prompt + output)
    torch.testing.assert_close(ours, expected)


def test_presence_and_frequency_penalties_follow_openai(logits):
    ours = apply_penalties(logits.clone(), SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2], [7, 7, 9])
    expected = logits.clone()
    expected[7] -= 0.5 + 2 * 0.25
    expected[9] -= 0.5 + 1 * 0.25
    torch.testing.assert_close(ours, expected)  # prompt tokens 1 and 2 are not penalised


def test_greedy_and_degenerate_filters_pick_argmax(logits):
    best = int(logits.argmax())
    g = make_generator(0)
    for params in [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                   SamplingParams(min_p=1.0)]:
        assert sample_one(logits.clone(), params, [], [], g)[0] == best


def test_sampling_follows_the_distribution(logits):
    params = SamplingParams(temperature=1.0)
    g = make_generator(123)
    counts = torch.zeros(VOCAB)
    for _ in range(4000):
        counts[sample_one(logits, params, [], [], g)[0]] += 1
    probs = logits.softmax(-1)
    top = int(probs.argmax())
    assert abs(counts[top] / 4000 - probs[top]) < 0.03


def test_every_token_is_drawn_at_its_probability(logits):
    """Chi-square over the whole vocabulary (the sampler inverts the CDF itself): 20000 seeded
    draws at temperature 0.8 and top_k 20; tokens top_k removed are never drawn."""
    params = SamplingParams(temperature=0.8, top_k=20)
    g = make_generator(7)
    counts = torch.zeros(VOCAB)
    for _ in range(20000):
        counts[sample_one(logits, params, [], [], g)[0]] += 1
    probs = filter_logits(logits.clone(), params).softmax(-1)
    assert counts[probs == 0].sum() == 0
    keep = probs * 20000 >= 5  # chi-square wants >= 5 expected per bin; the rest pooled in one
    expected = torch.cat([probs[keep], probs[~keep].sum()[None]]) * 20000
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    chi2 = float(((observed - expected) ** 2 / expected.clamp_min(1e-9)).sum())
    assert chi2 < 60.0, chi2  # at most 20 degrees of freedom: 60 is beyond the 1e-5 tail (~51)


def test_logprobs_are_the_model_distribution(logits):
    token, info = sample_one(logits, SamplingParams(temperature=0, logprobs=3, repetition_penalty=2.0), [int(logits.argmax())], [], make_generator(0))
    lp = torch.log_softmax(logits, -1)
    assert info.token_id == token
    assert info.logprob == pytest.approx(float(lp[token]))
    assert [t for t, _ in info.top] == torch.topk(lp, 3).indices.tolist()


def test_invalid_parameters_name_the_parameter():
    with pytest.raises(InvalidParameter, match=r"top_p must be in \[0.0, 1.0\]"):
        SamplingParams(top_p=1.5)
    for field, value in [("max_tokens", 0), ("temperature", 2.5), ("temperature", -0.1), ("top_p", -1e-9),
                         ("presence_penalty", 2.01), ("frequency_penalty", -3), ("logprobs", 21), ("n", 0),
                         ("repetition_penalty", 1e-30), ("repetition_penalty", 0), ("min_p", 1.5),
                         ("temperature", float("nan")), ("top_p", float("inf")), ("seed", 1 << 64),
                         ("seed", -(1 << 63) - 1), ("top_k", -2)]:
        with pytest.raises(InvalidParameter) as e:
            SamplingParams(**{field: value})
        assert e.value.param == field and field in str(e.value)


def test_degenerate_values_inside_the_ranges_sample_sanely(logits):
    """Values a client may send that used to underflow to inf/NaN probabilities and fail the step:
    a temperature below SAMPLING_EPS is greedy, a top_p of 0 (or one that rounds to 0 in fp32)
    keeps the best token, the smallest repetition penalty keeps logits finite."""
    best = int(logits.argmax())
    g = make_generator(0)
    for params in [SamplingParams(temperature=1e-30), SamplingParams(temperature=5e-324),
                   SamplingParams(top_p=0.0), SamplingParams(top_p=1e-50), SamplingParams(temperature=2.0, top_p=0)]:
        assert sample_one(logits.clone(), params, [], [], g)[0] == best
    p = SamplingParams(repetition_penalty=0.01, temperature=1e-5)  # at the epsilon: sampled, not greedy
    assert not p.greedy and SamplingParams(temperature=9.9e-6).greedy
    for _ in range(20):
        assert 0 <= sample_one(logits.clone(), p, list(range(VOCAB)), [], g)[0] < VOCAB


def test_non_finite_logits_fall_back_to_the_best_finite_token(logits):
    """A model that produced NaN/inf logits must not make multinomial raise (which failed every
    sequence in the step): that sequence gets its most likely finite token."""
    bad = logits.clone()
    bad[3] = float("nan")
    best = int(torch.nan_to_num(bad, nan=float("-inf")).argmax())
    assert sample_one(bad.clone(), SamplingParams(temperature=1.0), [], [], make_generator(0))[0] == best
    assert sample_one(bad.clone(), SamplingParams(temperature=0), [], [], make_generator(0))[0] == best
    inf = logits.clone()
    inf[9] = float("inf")
    assert sample_one(inf, SamplingParams(temperature=0.7), [], [], make_generator(0))[0] == 9


def test_choice_seeds_wrap_inside_64_bits():
    from engine.sampling_params import SEED_MAX, SEED_MIN, choice_seed

    assert choice_seed(None, 3) is None
    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(SEED_MAX, 1) == SEED_MIN
    assert all(SEED_MIN <= choice_seed(SEED_MAX - 1, i) <= SEED_MAX for i in range(64))
    make_generator(choice_seed(SEED_MAX, 0))  # torch takes both ends
    make_generator(choice_seed(SEED_MAX, 1))


@pytest.fixture(scope="module")
def llm(model_dirs):
    llm = LLM(str(model_dirs["qwen2"]), max_model_len=128, max_num_seqs=4)
    yield llm
    llm.close()


PROMPT = [10, 20, 30, 40]


def test_same_seed_same_tokens(llm):
    p = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    b = llm.generate([PROMPT], p)[0].outputs[0].token_ids
    c = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=8, ignore_eos=True))
    assert a == b
    assert a != c[0].outputs[0].token_ids


def test_stop_token_ids_and_max_tokens(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    stop_at = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_at)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == greedy.token_ids[:first + 1]


def test_stop_string_is_not_in_the_text(llm):
    full = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[4:6]
    cut = full.text.index(stop)
    out = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[:cut]


def test_n_choices_and_logprobs(llm):
    res = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=1.0, n=3, seed=1, logprobs=2,
                                                ignore_eos=True))[0]
    assert len(res.outputs) == 3
    assert all(len(o.logprobs) == 5 and len(o.logprobs[0].top) == 2 for o in res.outputs)
    assert len({tuple(o.token_ids) for o in res.outputs}) > 1


def test_prompt_logprobs_match_transformers(model_dirs):
    """prompt_logprobs under chunked prefill (5 tokens a step, so a 23-token prompt takes five
    steps), beside another request in the same steps, with the prompt's prefix in the prefix cache:
    every prompt token but the first scored as transformers scores it on the same weights, with its
    top alternatives."""
    from transformers import AutoModelForCausalLM

    folder = model_dirs["llama"]
    prompt = [(7 * i + 3) % 200 + 1 for i in range(23)]
    ref_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(ref_model(torch.tensor([prompt])).logits[0].float(), -1)  # (tokens, vocab)
    llm = LLM(str(folder), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=5)
    try:
        # First without: its prompt's full blocks go to the prefix cache, which scoring must not use.
        plain = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
        other, scored = llm.generate([PROMPT, prompt], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=3,
                                                                      ignore_eos=True))
    finally:
        llm.close()
    lp = scored.prompt_logprobs
    assert len(lp) == len(prompt) and lp[0] is None
    assert [e.token_id for e in lp[1:]] == prompt[1:]
    expected = [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert [e.logprob for e in lp[1:]] == pytest.approx(expected, abs=1e-4)
    for i, e in enumerate(lp[1:]):
        assert [t for t, _ in e.top] == torch.topk(ref[i], 3).indices.tolist()
    assert len(other.prompt_logprobs) == len(PROMPT)
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids and plain.prompt_logprobs is None
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"
