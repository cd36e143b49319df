"""Translation between OpenAI requests and engine requests, and engine outputs back to OpenAI
responses (whole, or as SSE chunks). No HTTP here and no engine logic: prompts become token ids,
fields become SamplingParams, and RequestOutput deltas become choices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.engine_loop import EngineLoop, EngineRequest, RequestHandle
from engine.llm_engine import RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import InvalidParameter, SamplingParams

from .errors import APIError, ModelNotFoundError, error_for
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
                       CompletionRequest, CompletionResponse, DeltaMessage, ModelCard, ModelList, TopLogprob,
                       UsageInfo, random_id, sse)

log = logging.getLogger("layerstream.server")

MAX_N = 64  # choices per request: each one is a sequence in the engine
DONE = sse("[DONE]")


@dataclass
class _Choice:
    """What one choice has accumulated so far."""

    index: int
    echo_text: str = ""  # the prompt, when echo is on
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False
    num_output_tokens: int = 0


@dataclass
class _Job:
    """One HTTP request in the engine: its choices by engine request id."""

    response_id: str
    created: int
    handle: RequestHandle
    choices: dict[str, _Choice]
    prompt_tokens: int

    def usage(self) -> UsageInfo:
        done = sum(c.num_output_tokens for c in self.choices.values())
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=done,
                         total_tokens=self.prompt_tokens + done)

    def apply(self, out: RequestOutput) -> _Choice:
        c = self.choices[out.request_id]
        c.text += out.text
        c.logprobs += out.logprobs
        c.num_output_tokens = out.num_output_tokens
        if out.finished:
            c.finish_reason = _finish_reason(out.finish_reason)
        return c


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


async def _event_stream(job: _Job, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """What every streamed response does around its chunks: an error after the status line was sent
    becomes an error event, the job's engine requests are aborted however the stream ends (no-op
    when they finished; a client that went away frees its slots), and [DONE] closes the stream."""
    try:
        async with contextlib.aclosing(chunks):
            async for event in chunks:
                yield event
    except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
        yield error_for(e).sse()
    finally:
        job.handle.abort()
    yield DONE


class OpenAIServing:
    def __init__(self, engine: EngineLoop, served_model_name: str):
        self.engine = engine
        self.model_name = served_model_name

    # -- shared ------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFoundError(name, self.model_name)

    def models(self) -> ModelList:
        max_len = self.engine.max_model_len if self.engine.ready else None
        return ModelList(data=[ModelCard(id=self.model_name, max_model_len=max_len)])

    def _params(self, req, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if not 1 <= req.n <= MAX_N:
            raise InvalidParameter("n", f"n must be in [1, {MAX_N}], got {req.n}")
        best_of = getattr(req, "best_of", None)
        if best_of is not None and best_of > req.n:
            raise InvalidParameter("best_of", f"best_of > n is not supported (got best_of {best_of}, n {req.n})")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids or [],
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
        )

    async def _submit(self, prompts: list[list[int]], req, params: SamplingParams, prefix: str,
                      echo_texts: list[str] | None = None) -> _Job:
        """Submit n engine requests per prompt (seed + i when seeded, as engine.llm does) and wait
        until the engine has taken all of them, so admission errors become a status code."""
        response_id = random_id(prefix)
        requests, choices = [], {}
        for p, ids in enumerate(prompts):
            for i in range(req.n):
                rid = f"{response_id}-{p}-{i}"
                seed = None if params.seed is None else params.seed + i
                requests.append(EngineRequest(rid, ids, dataclasses.replace(params, seed=seed)))
                choices[rid] = _Choice(p * req.n + i, echo_texts[p] if echo_texts else "")
        handle = self.engine.submit(requests)
        try:
            await handle.accepted
        except BaseException:
            handle.abort()
            raise
        return _Job(response_id, int(time.time()), handle, choices, sum(len(ids) for ids in prompts))

    async def _collect(self, job: _Job) -> None:
        try:
            async for out in job.handle.outputs():
                job.apply(out)
        finally:
            job.handle.abort()  # no-op when finished; a cancelled request (client gone) frees its slot

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    # -- /v1/completions --------------------------------------------------------------------------
    def _completion_prompts(self, prompt) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise InvalidParameter("prompt", "prompt must not be empty")
        try:
            ids = [self.engine.encode(p) for p in prompts]
        except ValueError as e:
            raise InvalidParameter("prompt", str(e)) from e
        if any(not x for x in ids):
            raise InvalidParameter("prompt", "prompt must not be empty")
        return ids

    async def completions(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.suffix:
            raise InvalidParameter("suffix", "suffix is not supported")
        if req.echo and req.logprobs is not None:
            raise InvalidParameter("echo", "echo together with logprobs (prompt logprobs) is not supported")
        prompts = self._completion_prompts(req.prompt)
        params = self._params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs)
        echo = [self.engine.tokenizer.decode(ids) for ids in prompts] if req.echo else None
        job = await self._submit(prompts, req, params, "cmpl", echo)
        if req.stream:
            return _event_stream(job, self._completion_chunks(job, req))
        await self._collect(job)
        choices = [CompletionChoice(index=c.index, text=c.echo_text + c.text, finish_reason=c.finish_reason,
                                    logprobs=self._completion_logprobs(c.logprobs, [len(c.echo_text)])
                                    if req.logprobs is not None else None)
                   for c in sorted(job.choices.values(), key=lambda c: c.index)]
        return CompletionResponse(id=job.response_id, created=job.created, model=self.model_name,
                                  choices=choices, usage=job.usage())

    def _completion_logprobs(self, infos: list[TokenLogprobs], offset: list[int]) -> CompletionLogprobs:
        """offset: [character offset of the next token in the choice's text], advanced in place so a
        stream's chunks continue where the previous one ended."""
        lp = CompletionLogprobs()
        for info in infos:
            tok = self._token_text(info.token_id)
            lp.text_offset.append(offset[0])
            lp.tokens.append(tok)
            lp.token_logprobs.append(info.logprob)
            top: dict[str, float] = {}
            for t, v in info.top:  # best first; two ids with the same text keep the better logprob
                top.setdefault(self._token_text(t), v)
            lp.top_logprobs.append(top)
            offset[0] += len(tok)
        return lp

    async def _completion_chunks(self, job: _Job, req: CompletionRequest) -> AsyncIterator[str]:
        offsets = {c.index: [len(c.echo_text)] for c in job.choices.values()}
        async for out in job.handle.outputs():
            c = job.apply(out)
            text = out.text
            if not c.started:
                c.started = True
                text = c.echo_text + text
            if not (text or out.finished or out.logprobs):
                continue  # text held back (incomplete character, possible stop string)
            logprobs = None
            if req.logprobs is not None:
                logprobs = self._completion_logprobs(out.logprobs, offsets[c.index])
            chunk = CompletionResponse(id=job.response_id, created=job.created, model=self.model_name,
                                       choices=[CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                                                 finish_reason=c.finish_reason)])
            yield sse(chunk)
        if _include_usage(req):
            yield sse(CompletionResponse(id=job.response_id, created=job.created, model=self.model_name,
                                         choices=[], usage=job.usage()))

    # -- /v1/chat/completions ---------------------------------------------------------------------
    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # content parts: only text is supported
                if any(p.get("type") != "text" for p in content):
                    raise InvalidParameter("messages", "only text content parts are supported")
                content = "".join(p.get("text", "") for p in content)
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template error is about the messages sent
            raise InvalidParameter("messages", f"the chat template failed on these messages: {e}") from e
        # The template writes any BOS itself; adding special tokens again would double it.
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidParameter("messages", "the rendered chat prompt is empty")
        return ids

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs: true")
        ids = self._chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(ids))
        params = self._params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        job = await self._submit([ids], req, params, "chatcmpl")
        if req.stream:
            return _event_stream(job, self._chat_chunks(job, req))
        await self._collect(job)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text), finish_reason=c.finish_reason,
                              logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None)
                   for c in sorted(job.choices.values(), key=lambda c: c.index)]
        return ChatCompletionResponse(id=job.response_id, created=job.created, model=self.model_name,
                                      choices=choices, usage=job.usage())

    def _chat_logprobs(self, infos: list[TokenLogprobs]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return dict(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(i.token_id, i.logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in i.top])
            for i in infos])

    async def _chat_chunks(self, job: _Job, req: ChatCompletionRequest) -> AsyncIterator[str]:
        def chunk(choices, usage=None) -> str:
            return sse(ChatCompletionChunk(id=job.response_id, created=job.created, model=self.model_name,
                                           choices=choices, usage=usage))

        for c in sorted(job.choices.values(), key=lambda c: c.index):
            yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
        async for out in job.handle.outputs():
            c = job.apply(out)
            if not (out.text or out.finished or out.logprobs):
                continue
            delta = DeltaMessage(content=out.text) if out.text or not out.finished else DeltaMessage()
            yield chunk([ChatChunkChoice(index=c.index, delta=delta, finish_reason=c.finish_reason,
                                         logprobs=self._chat_logprobs(out.logprobs) if req.logprobs else None)])
        if _include_usage(req):
            yield chunk([], job.usage())
