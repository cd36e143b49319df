"""Driving the engine with requests arriving at chosen steps, and the same requests served one at a time:
what continuous batching must not change."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams


MAX_LEN = 128
PROMPTS = {  # different lengths: 1 token, shorter and longer than a prefill chunk
    "a": [5],
    "b": [(i * 7 + 3) % 500 + 6 for i in range(11)],
    "c": [(i * 13 + 1) % 500 + 6 for i in range(29)],
    "d": [(i * 31 + 2) % 500 + 6 for i in range(45)],
}


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0, **kw)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    steps: list[int] = field(default_factory=list)  # engine steps in which a token arrived


def drive(engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
          aborts: dict[int, list[str]] | None = None, on_step=None) -> dict[str, Result]:
    """Run the engine step by step; `arrivals[k]` are added and `aborts[k]` cancelled before step k. An
    arrival may name a served LoRA adapter as a fourth item (None: the base)."""
    aborts = aborts or {}
    results: dict[str, Result] = {}
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for rid, prompt, params, *lora in arrivals.get(step, []):
            engine.add_request(prompt, params, rid, **({"lora_name": lora[0]} if lora else {}))
            results[rid] = Result()
        for rid in aborts.get(step, []):
            assert engine.abort(rid)
        for out in engine.step():
            r = results[out.request_id]
            r.tokens += out.new_token_ids
            r.logprobs += [lp.logprob for lp in out.logprobs]
            r.steps.append(step)
            if out.finished:
                r.finish_reason = out.finish_reason
        if on_step:
            on_step(step, engine)
        step += 1
        assert step < 1000
    return results


def one_at_a_time(llm: LLM):
    """run(prompt, params) -> Result: the request served alone by llm (memoised)."""
    cache: dict = {}

    def run(prompt: list[int], params: SamplingParams) -> Result:
        key = (tuple(prompt), repr(params))
        if key not in cache:
            cache[key] = drive(llm.engine, {0: [("solo", prompt, params)]})["solo"]
        return cache[key]

    return run


def assert_same(got: Result, want: Result) -> None:
    assert got.tokens == want.tokens
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=1e-4)
    assert got.finish_reason == want.finish_reason
