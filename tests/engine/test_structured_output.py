"""Structured output and logit_bias in the engine: a random-weight model, constrained by llguidance,
must still produce text that parses and validates; the masks are applied inside continuous batching
(constrained and free sequences in the same steps)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import sample_one, make_generator
from engine.sampling_params import InvalidParameter
from engine.structured_output import StructuredOutput, choice, json_schema
from tests.support.structured import SCHEMA


@pytest.fixture(scope="module")
def llm(llama_dir):
    m = LLM(str(llama_dir))
    yield m
    m.close()


def test_json_schema_outputs_validate_in_one_batch(llm):
    """8 constrained sequences sampled at temperature 1 beside 2 free ones, all in the same steps."""
    constrained = SamplingParams(max_tokens=120, temperature=1.0, seed=7, n=8, structured=json_schema(SCHEMA))
    free = SamplingParams(max_tokens=20, temperature=1.0, seed=7, n=2, ignore_eos=True)
    llm.engine.grammar.stats.masks = 0
    (res,) = llm.generate("Give me JSON:", constrained)
    for out in res.outputs:
        assert out.finish_reason == "stop", out
        jsonschema.validate(json.loads(out.text), SCHEMA)
    # Without the grammar the same seeds give text that is not JSON at all.
    (plain,) = llm.generate("Give me JSON:", free)
    with pytest.raises(ValueError):
        json.loads(plain.outputs[0].text)
    assert llm.engine.grammar.stats.masks >= sum(len(o.token_ids) for o in res.outputs)


def test_batched_mix_of_constraints(llm):
    """Different grammars and a free sequence added together run in the same steps."""
    eng = llm.engine
    rids = {
        eng.add_request("a", SamplingParams(max_tokens=40, seed=1, structured=StructuredOutput(
            "regex", r"[0-9]{3}-[a-z]{2}", "guided_regex"))): lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t),
        eng.add_request("b", SamplingParams(max_tokens=40, seed=2, structured=choice(["yes", "no", "maybe"]))):
            lambda t: t in ("yes", "no", "maybe"),
        eng.add_request("c", SamplingParams(max_tokens=60, seed=3, structured=StructuredOutput("json_object"))):
            lambda t: isinstance(json.loads(t), dict),
        eng.add_request("d", SamplingParams(max_tokens=40, seed=4, structured=StructuredOutput(
            "grammar", 'start: "go " DIR\nDIR: "north" | "south"', "guided_grammar"))):
            lambda t: t in ("go north", "go south"),
        eng.add_request("e", SamplingParams(max_tokens=5, seed=5, ignore_eos=True)): lambda t: True,
    }
    texts = {r: "" for r in rids}
    reasons = {}
    max_batch = 0
    while eng.has_unfinished():
        max_batch = max(max_batch, eng.num_running())
        for o in eng.step():
            texts[o.request_id] += o.text
            if o.finished:
                reasons[o.request_id] = o.finish_reason
    assert max_batch == 5
    for rid, ok in rids.items():
        assert ok(texts[rid]), (rid, texts[rid], reasons[rid])


def test_invalid_constraints_name_their_field(llm):
    g = llm.engine.grammar
    with pytest.raises(InvalidParameter) as e:
        g.check(StructuredOutput("regex", "[a-", "guided_regex"))
    assert e.value.param == "guided_regex"
    with pytest.raises(InvalidParameter) as e:
        g.check(StructuredOutput("grammar", "start: undefined_rule", "guided_grammar"))
    assert e.value.param == "guided_grammar"
    with pytest.raises(InvalidParameter) as e:
        json_schema(["not", "a", "schema"])
    assert e.value.param == "response_format"
    with pytest.raises(InvalidParameter):
        choice([])


def test_logit_bias_semantics():
    logits = torch.zeros(10)
    params = SamplingParams(temperature=0, logit_bias={3: 100.0})
    assert sample_one(logits.clone(), params, [0], [], make_generator(0))[0] == 3
    # -100 bans the token a greedy pick would take; the model's logprobs stay the model's own.
    logits[5] = 10.0
    token, info = sample_one(logits.clone(), SamplingParams(temperature=0, logit_bias={5: -100.0}, logprobs=0),
                             [0], [], make_generator(0))
    assert token != 5
    assert info.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]))
    # A grammar mask wins over a bias: a forced token outside the mask cannot be sampled.
    assert sample_one(logits.clone(), params, [0], [], make_generator(0), torch.tensor([7]))[0] == 7
    sampled = {sample_one(logits.clone(), SamplingParams(temperature=1.0, logit_bias={3: 100.0}), [0], [], g,
                          torch.tensor([2, 7]))[0] for g in [make_generator(0)] for _ in range(50)}
    assert sampled == {2, 7}


@pytest.mark.parametrize("bias", [100.5, -101.0])
def test_logit_bias_range(bias):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(logit_bias={1: bias})
    assert e.value.param == "logit_bias"


def test_logit_bias_unknown_token(llm):
    with pytest.raises(InvalidParameter) as e:
        llm.engine.add_request("x", SamplingParams(logit_bias={512: 1.0}))
    assert e.value.param == "logit_bias"
    assert not llm.engine.has_unfinished()


def test_logit_bias_forcing_eos_ends_at_once(llm):
    eos = llm.tokenizer.eos_token_id
    (res,) = llm.generate("Hello", SamplingParams(temperature=1.0, seed=0, max_tokens=10, logit_bias={eos: 100.0}))
    out = res.outputs[0]
    assert out.finish_reason == "stop" and out.text == "" and out.token_ids == [eos]


def test_guide_in_error_state_allows_only_end_of_sequence(llm):
    """A token the grammar refuses (which the mask never lets through) leaves the matcher in error;
    the sequence can then only end, instead of sampling from an all -inf row."""
    g = llm.engine.grammar.guide(choice(["yes", "no"]))
    g.accept(llm.tokenizer.encode("z")[0])
    assert g.error and g.stopped
    assert g.allowed().tolist() == llm.engine.grammar.eos_token_ids
