"""Translation between OpenAI requests and engine requests, and engine outputs back to OpenAI
responses (whole, or as SSE chunks). No HTTP here and no engine logic: prompts become token ids,
fields become SamplingParams, and RequestOutput deltas become choices.

CPU work that grows with the request (lone-surrogate scan, chat template, tokenizing, echo
decoding) runs on one tokenizer thread, never on the event loop, so /health and every stream keep
answering while a large prompt is prepared; the request-shape caps (limits.RequestLimits) are
checked before any of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

from engine.engine_loop import EngineLoop, EngineRequest, RequestHandle
from engine.request import RequestOutput
from engine.sampler import TokenLogprobs
from engine.sampling_params import InvalidParameter, SamplingParams, normalize_prompts

from . import structured, tools
from .errors import APIError, ModelNotFoundError, error_for
from .limits import RequestLimits
from .protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                       ChatCompletionResponse, ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
                       CompletionRequest, CompletionResponse, DeltaMessage, DeltaToolCall, LoadLoRAAdapterRequest,
                       ModelCard, ModelList, ToolCallInfo, TopLogprob, UnloadLoRAAdapterRequest, UsageInfo,
                       lone_surrogate, random_id, sse)

log = logging.getLogger("layerstream.server")

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
    tool_parser: tools.ToolCallParser | None = None  # chat with tools: text -> content + tool calls
    stop_reason: str | int | None = None  # the stop string / token that ended it
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # echo with logprobs: from the first output


@dataclass
class _Job:
    """One HTTP request in the engine: its choices by engine request id."""

    response_id: str
    created: int
    handle: RequestHandle
    choices: dict[str, _Choice]
    prompt_tokens: int
    model: str  # what the request asked for: the served model's name or a LoRA adapter's (responses echo it)

    def usage(self) -> UsageInfo:
        done = sum(c.num_output_tokens for c in self.choices.values())
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=done,
                         total_tokens=self.prompt_tokens + done)

    def apply(self, out: RequestOutput) -> _Choice:
        c = self.choices[out.request_id]
        c.text += out.text
        c.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        c.num_output_tokens = out.num_output_tokens
        if out.finished:
            c.finish_reason = _finish_reason(out.finish_reason)
            c.stop_reason = out.stop_reason
        return c


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _check_stream_options(req) -> None:
    # Only a stream has a usage chunk to add: accepted without one, the option would do nothing.
    if req.stream_options is not None and not req.stream:
        raise InvalidParameter("stream_options", "stream_options is only allowed with stream: true")


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
    def __init__(self, engine: EngineLoop, served_model_name: str, limits: RequestLimits | None = None,
                 tool_call_parser: str = "auto"):
        self.engine = engine
        self.model_name = served_model_name
        self.limits = limits or RequestLimits()
        tools.format_for(tool_call_parser, None)  # a bad choice fails here, not at the first request
        self.tool_call_parser = tool_call_parser
        # One thread: the tokenizer is one object, and HF fast tokenizers are not safe to share
        # between threads that may change its settings; the event loop only awaits it.
        self._cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerstream-tokenize")
        self._max_prompt_chars: int | None = None

    def max_prompt_chars(self) -> int | None:
        """Characters beyond which a text prompt can never fit the context: max_model_len tokens of
        the vocabulary's longest token (special tokens included). None while loading."""
        if self._max_prompt_chars is None and self.engine.ready:
            longest = max((len(t) for t in self.engine.tokenizer.get_vocab()), default=1)
            self._max_prompt_chars = self.engine.max_model_len * max(1, longest)
        return self._max_prompt_chars

    def body_limit(self) -> int:
        return self.limits.body_limit(self.max_prompt_chars())

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    def check_text(self, req, param: str, texts: list[str]) -> None:
        """Refuse, before tokenizing, invalid Unicode anywhere in the request and text that could
        never fit the context."""
        path = lone_surrogate(req)
        if path is not None:
            raise InvalidParameter(path, f"{path} holds a lone UTF-16 surrogate (invalid Unicode); send valid "
                                         "UTF-8 text")
        limit = self.max_prompt_chars()
        chars = sum(len(t) for t in texts)
        if limit is not None and chars > limit:
            raise InvalidParameter(param, f"the {param} has {chars} characters: more than this model's maximum "
                                          f"context length of {self.engine.max_model_len} tokens could hold, "
                                          f"however it were tokenized (at most {limit} characters)")

    # -- shared ------------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's model field names, None for the base model (or no model given);
        ModelNotFoundError (404) for a name that is neither."""
        if name is None or name == self.model_name:
            return None
        if any(a.name == name for a in self.engine.lora_adapters()):
            return name
        raise ModelNotFoundError(name, self._names())

    def _names(self) -> list[str]:
        return [self.model_name] + [a.name for a in self.engine.lora_adapters()]

    def models(self) -> ModelList:
        """The base model, then each LoRA adapter with the base as its parent (as vLLM lists them)."""
        return ModelList(data=[self.model(self.model_name)]
                         + [self._adapter_card(a) for a in self.engine.lora_adapters()])

    def model(self, name: str) -> ModelCard:
        if name != self.model_name:
            adapter = next((a for a in self.engine.lora_adapters() if a.name == name), None)
            if adapter is None:
                raise ModelNotFoundError(name, self._names())
            return self._adapter_card(adapter)
        max_len = self.engine.max_model_len if self.engine.ready else None
        return ModelCard(id=self.model_name, root=self.model_name, max_model_len=max_len)

    def _adapter_card(self, adapter) -> ModelCard:
        return ModelCard(id=adapter.name, root=adapter.path, parent=self.model_name,
                         max_model_len=self.engine.max_model_len if self.engine.ready else None)

    async def load_lora(self, req: LoadLoRAAdapterRequest) -> str:
        """Serve another adapter (vLLM's /v1/load_lora_adapter): 400 for a name already served (the base's
        included) or a folder that is not an adapter this model can serve."""
        if req.lora_name in self._names():
            raise APIError(400, f"The lora adapter '{req.lora_name}' has already been loaded."
                           if req.lora_name != self.model_name else
                           f"'{req.lora_name}' is the served model's name; choose another adapter name",
                           param="lora_name")
        await self.engine.load_lora(req.lora_name, req.lora_path)
        return f"Success: LoRA adapter '{req.lora_name}' added successfully."

    async def unload_lora(self, req: UnloadLoRAAdapterRequest) -> str:
        """Stop serving an adapter (vLLM's /v1/unload_lora_adapter): 404 for an unknown name, 400 while
        requests using it are in flight (they are not cancelled: unload once they finish)."""
        await self.engine.unload_lora(req.lora_name)
        return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

    def tool_format(self) -> str:
        """How the served model writes tool calls (tools.FORMATS), from the flag or its template."""
        return tools.format_for(self.tool_call_parser, getattr(self.engine.tokenizer, "chat_template", None))

    async def _structured(self, req, extra=None):
        """The request's output constraint (from response_format / guided_* / structured_outputs, or
        `extra` from tool_choice), compiled off the event loop so a 400 comes before any work."""
        so = structured.structured_output(req)
        if so is not None and extra is not None:
            raise InvalidParameter(so.param, f"{so.param} cannot be combined with tool_choice required or a "
                                             "named function, which constrain the output themselves")
        so = so or extra
        if so is not None:
            await asyncio.to_thread(self.engine.check_structured, so)
        return so

    async def _check_tools(self, plan: tools.ToolPlan) -> None:
        """Every tool's parameter schema, compiled off the event loop (cached), whatever tool_choice."""
        for so in plan.schemas():
            await asyncio.to_thread(self.engine.check_structured, so)

    def _params(self, req, max_tokens: int, logprobs: int | None, structured_output=None) -> SamplingParams:
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
            logit_bias=structured.logit_bias(req),
            structured=structured_output,
        )

    async def _submit(self, prompts: list[list[int]], req, params: SamplingParams, prefix: str,
                      echo_texts: list[str] | None = None, tool_plan: tools.ToolPlan | None = None,
                      lora_name: str | None = None) -> _Job:
        """Submit n engine requests per prompt (seed + i when seeded, as engine.llm does), under the LoRA
        adapter lora_name if any, and wait until the engine has taken all of them, so admission errors
        become a status code."""
        response_id = random_id(prefix)
        requests, choices = [], {}
        for p, ids in enumerate(prompts):
            for i, choice in enumerate(dataclasses.replace(params, n=req.n).per_choice()):
                rid = f"{response_id}-{p}-{i}"
                requests.append(EngineRequest(rid, ids, choice, lora_name))
                choices[rid] = _Choice(p * req.n + i, echo_texts[p] if echo_texts else "",
                                       tool_parser=tool_plan.parser() if tool_plan and tool_plan.active else None,
                                       prompt_ids=ids)
        handle = self.engine.submit(requests)
        try:
            await handle.accepted
        except BaseException:
            handle.abort()
            raise
        return _Job(response_id, int(time.time()), handle, choices, sum(len(ids) for ids in prompts),
                    lora_name or self.model_name)

    async def collect(self, job: _Job) -> None:
        try:
            async for out in job.handle.outputs():
                job.apply(out)
        finally:
            job.handle.abort()  # no-op when finished; a cancelled request (client gone) frees its slot

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    # -- /v1/completions --------------------------------------------------------------------------
    def _completion_prompts(self, req: CompletionRequest, prompts: list) -> tuple[list[list[int]], list[str] | None]:
        """On the tokenizer thread: token ids of each prompt, and their text when echo is on."""
        self.check_text(req, "prompt", [p for p in prompts if isinstance(p, str)])
        try:
            ids = [self.engine.encode(p) for p in prompts]
        except ValueError as e:
            raise InvalidParameter("prompt", str(e)) from e
        if any(not x for x in ids):
            raise InvalidParameter("prompt", "prompt must not be empty")
        return ids, self._echo_texts(req.prompt, ids) if req.echo else None

    async def completions(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        lora_name = self.check_model(req.model)
        if req.suffix:
            raise InvalidParameter("suffix", "suffix is not supported")
        _check_stream_options(req)
        raw = normalize_prompts(req.prompt)
        if not raw:
            raise InvalidParameter("prompt", "prompt must not be empty")
        self.limits.check(req, len(raw), self.engine.capacity)
        so = await self._structured(req)
        params = self._params(req, 16 if req.max_tokens is None else req.max_tokens, req.logprobs, so)
        if req.echo and req.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=req.logprobs)  # the echoed prompt scored too
        prompts, echo = await self.off_loop(self._completion_prompts, req, raw)
        job = await self._submit(prompts, req, params, "cmpl", echo, lora_name=lora_name)
        if req.stream:
            return _event_stream(job, self._completion_chunks(job, req))
        await self.collect(job)
        choices = [CompletionChoice(index=c.index, text=c.echo_text + c.text, finish_reason=c.finish_reason,
                                    logprobs=self._with_prompt(c, self._completion_logprobs(c.logprobs,
                                                                                            [len(c.echo_text)]))
                                    if req.logprobs is not None else None)
                   for c in sorted(job.choices.values(), key=lambda c: c.index)]
        return CompletionResponse(id=job.response_id, created=job.created, model=job.model,
                                  choices=choices, usage=job.usage())

    def _echo_texts(self, prompt, ids: list[list[int]]) -> list[str]:
        """What echo puts before each completion: the prompt exactly as sent (text prompts), or the
        text of the token ids sent, special tokens included."""
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str):
            return list(prompt)
        return [self.engine.tokenizer.decode(x) for x in ids]

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

    def _with_prompt(self, c: _Choice, completion: CompletionLogprobs) -> CompletionLogprobs:
        """Echo with logprobs: the prompt's tokens first (the first has no logprob, as OpenAI
        sends it: nothing precedes it), their offsets counted from the start of the echoed text."""
        if c.prompt_logprobs is None:
            return completion
        lp = CompletionLogprobs(text_offset=[0], tokens=[self._token_text(c.prompt_ids[0])],
                                token_logprobs=[None], top_logprobs=[None])
        rest = self._completion_logprobs(c.prompt_logprobs[1:], [len(lp.tokens[0])])
        for name in ("text_offset", "tokens", "token_logprobs", "top_logprobs"):
            getattr(lp, name).extend(getattr(rest, name) + getattr(completion, name))
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
                if out.prompt_logprobs is not None:
                    logprobs = self._with_prompt(c, logprobs)
            chunk = CompletionResponse(id=job.response_id, created=job.created, model=job.model,
                                       choices=[CompletionChoice(index=c.index, text=text, logprobs=logprobs,
                                                                 finish_reason=c.finish_reason)])
            yield sse(chunk)
        if _include_usage(req):
            yield sse(CompletionResponse(id=job.response_id, created=job.created, model=job.model,
                                         choices=[], usage=job.usage()))

    # -- /v1/chat/completions ---------------------------------------------------------------------
    def chat_prompt_ids(self, req: ChatCompletionRequest, plan: tools.ToolPlan) -> list[int]:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                           param="messages")
        messages = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):  # text parts (the only type the request model accepts)
                content = "".join(p.text for p in content)
            messages.append({**(m.model_extra or {}), "role": m.role, "content": content or ""})
        self.check_text(req, "messages", [m["content"] for m in messages])
        tools.check_messages(messages)
        # A template that reads `tools` renders them (and calls, results) itself; others get text.
        native = "tools" in tok.chat_template
        messages = tools.template_messages(messages, plan, native)
        extra = {"tools": list(plan.tools)} if native and plan.active else {}
        try:
            text = tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=req.add_generation_prompt, **extra)
        except Exception as e:  # noqa: BLE001 - a template error is about the messages sent
            raise InvalidParameter("messages", f"the chat template failed on these messages: {e}") from e
        # The template writes any BOS itself; adding special tokens again would double it.
        ids = tok.encode(text, add_special_tokens=False)
        if not ids:
            raise InvalidParameter("messages", "the rendered chat prompt is empty")
        try:
            self.engine.encode(ids)  # the token-id range check (added tokens beyond the embedding table)
        except ValueError as e:
            raise InvalidParameter("messages", str(e)) from e
        return ids

    async def chat(self, req: ChatCompletionRequest) -> ChatCompletionResponse | AsyncIterator[str]:
        job = await self.start_chat(req)
        if req.stream:
            return _event_stream(job, self._chat_chunks(job, req))
        await self.collect(job)
        choices = [ChatChoice(index=c.index, message=self.message(c),
                              finish_reason=tools.finish_reason(c.finish_reason, c.tool_parser),
                              logprobs=self._chat_logprobs(c.logprobs) if req.logprobs else None)
                   for c in sorted(job.choices.values(), key=lambda c: c.index)]
        return ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model,
                                      choices=choices, usage=job.usage())

    async def start_chat(self, req: ChatCompletionRequest) -> _Job:
        """Everything a chat request does before its outputs arrive: checks, prompt, submission.
        The Messages API (server.anthropic) shares it."""
        lora_name = self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs: true")
        _check_stream_options(req)
        self.limits.check(req, 1, self.engine.capacity)
        plan = tools.plan_tools(req, self.tool_format())
        await self._check_tools(plan)
        ids = await self.off_loop(self.chat_prompt_ids, req, plan)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, self.engine.max_model_len - len(ids))
        so = await self._structured(req, plan.structured())
        params = self._params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, so)
        if plan.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        return await self._submit([ids], req, params, "chatcmpl", tool_plan=plan, lora_name=lora_name)

    @staticmethod
    def message(c: _Choice) -> AssistantMessage:
        if c.tool_parser is None:
            return AssistantMessage(content=c.text)
        content, calls = c.tool_parser.advance(c.text, finished=True)
        return AssistantMessage(content=None if (calls or c.tool_parser.plan.forced) and not content.strip() else content,
                                tool_calls=[ToolCallInfo(**t.openai()) for t in calls] or None)

    def _chat_logprobs(self, infos: list[TokenLogprobs]) -> ChatLogprobs:
        def entry(token_id: int, logprob: float) -> dict:
            text = self._token_text(token_id)
            return dict(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(i.token_id, i.logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in i.top])
            for i in infos])

    async def _chat_chunks(self, job: _Job, req: ChatCompletionRequest) -> AsyncIterator[str]:
        def chunk(choices, usage=None) -> str:
            return sse(ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model,
                                           choices=choices, usage=usage))

        for c in sorted(job.choices.values(), key=lambda c: c.index):
            yield chunk([ChatChunkChoice(index=c.index, delta=DeltaMessage(role="assistant", content=""))])
        async for out in job.handle.outputs():
            c = job.apply(out)
            text, calls = out.text, []
            if c.tool_parser is not None:
                seen = len(c.tool_parser.calls)
                text, new = c.tool_parser.advance(out.text, out.finished)
                calls = [DeltaToolCall(**t.openai(seen + i)) for i, t in enumerate(new)]
            if not (text or calls or out.finished or out.logprobs):
                continue
            delta = DeltaMessage(content=text or None, tool_calls=calls or None)
            if not (text or calls) and not out.finished:
                delta = DeltaMessage(content="")
            yield chunk([ChatChunkChoice(index=c.index, delta=delta,
                                         finish_reason=tools.finish_reason(c.finish_reason, c.tool_parser),
                                         logprobs=self._chat_logprobs(out.logprobs) if req.logprobs else None)])
        if _include_usage(req):
            yield chunk([], job.usage())
