"""One request inside the engine: its state between steps, and how its tokens are emitted (the stop
rules: a stop token, a stop string, a complete grammar, max_tokens, the context) as RequestOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .detokenizer import IncrementalDetokenizer
from .sampler import TokenLogprobs
from .sampling_params import InvalidParameter, SamplingParams
from .scheduler import Sequence
from .structured_output import Guide


@dataclass
class RequestOutput:
    """What one step produced for one request: deltas, plus totals once it finishes."""

    request_id: str
    new_token_ids: list[int]
    text: str  # text delta
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" (failed alone, see LLMEngine.step)
    stop_reason: str | int | None = None  # the stop string or stop_token_ids entry that ended it (vLLM's name)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # With SamplingParams.prompt_logprobs, on a request's first output: one entry per prompt
    # token, None for the first (nothing precedes it to score it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # finish_reason "error" because of the request itself (its grammar over budget): the error to
    # send the client, an InvalidParameter. None: the engine failed it (details in the log only).
    error: InvalidParameter | None = None


@dataclass
class RequestState:
    """What the engine keeps for a request between steps (Sequence.state; the scheduler never reads it)."""

    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer
    stop_ids: set[int]
    guide: Guide | None = None  # structured output: the grammar this sequence follows
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # filled by position as prefill runs
    spec_k: int = 0  # speculative decoding: tokens this sequence drafts next (adaptive.DraftLength)
    # Structured output: the logits (vocab,) of a step whose grammar mask was not ready in time;
    # the sequence samples from them at a later step, once it is.
    held_logits: torch.Tensor | None = None


def emit(seq: Sequence, tokens: list[int], infos: list, max_model_len: int,
         commit: Callable[[int], None] | None = None, prompt_logprobs: list | None = None,
         reason: str | None = None) -> RequestOutput:
    """Append tokens to seq one at a time, as decoding them one per step would, up to the first that
    finishes it (the rest, speculative ones, are dropped), and say what the client sees. commit(emitted):
    a verify pass's K/V accounting, once the tokens it publishes are in the sequence (and before the
    caller finishes a finished sequence, which gives its blocks back). reason: finish with it whatever the
    tokens (none, when a complete grammar ends the sequence). A grammar that fails on a token raises its
    failure: the caller ends this request with it, alone."""
    st: RequestState = seq.state
    emitted = []
    for token in tokens:
        seq.output_ids.append(token)
        emitted.append(token)
        if token in st.stop_ids:
            reason = "stop"
        else:
            st.detok.add_token(token)
            if st.guide is not None:
                st.guide.accept(token)
                if st.guide.failure is not None:
                    raise st.guide.failure
            if st.detok.stopped or (st.guide is not None and st.guide.finished):
                # A complete grammar admits only end-of-sequence: end now rather than spend a step on it.
                reason = "stop"
            elif len(seq.output_ids) >= seq.max_tokens or seq.num_tokens >= max_model_len:
                reason = "length"
        if reason:
            break
    token = emitted[-1] if emitted else None
    if commit is not None:
        commit(len(emitted))
    if reason:
        st.detok.flush()
    return RequestOutput(
        request_id=seq.request_id,
        new_token_ids=emitted,
        text=st.detok.take_delta(final=reason is not None),
        logprobs=[i for i in infos[:len(emitted)] if i is not None],
        finished=reason is not None,
        finish_reason=reason,
        stop_reason=st.detok.stop_string or (token if token in st.params.stop_token_ids else None),
        num_prompt_tokens=len(seq.prompt_ids),
        num_output_tokens=len(seq.output_ids),
        prompt_logprobs=prompt_logprobs,
    )
