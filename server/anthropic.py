"""Anthropic's Messages API (`POST /v1/messages`) on the same engine path as chat completions: the
request is translated into a `ChatCompletionRequest` (system, turns, tool_use / tool_result
blocks, tools, tool_choice, stop_sequences, max_tokens, sampling fields) and the chat job's outputs
are shaped back into a Message, or into Anthropic's stream events (message_start,
content_block_start / _delta / _stop, message_delta, message_stop; ping once at the start).

`output_config.format` (a JSON schema) is structured output, as in Anthropic's API. Older clients'
temperature / top_p / top_k are accepted (Anthropic's ranges). Not supported, refused with a 400:
image and document blocks ("images are not supported"), extended thinking, output_config.effort.
Refused as Anthropic refuses them: a message with empty content (but a final assistant prefill),
and a tool_result that answers no tool_use of the assistant message just before it.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling_params import InvalidParameter

from . import tools
from .errors import error_for
from .protocol import ChatCompletionRequest, _Request, random_id


class _Block(_Request):
    """One content block of the conversation so far. Fields by type: text (text), tool_use (id, name,
    input), tool_result (tool_use_id, content, is_error). Clients send earlier answers back as they
    received them, with response metadata (citations, caller...) that says nothing about what to
    generate next: other fields are let through, not refused."""

    model_config = ConfigDict(extra="ignore")

    # image / document: parsed only to be refused by name (_unsupported), not with a schema error.
    type: Literal["text", "tool_use", "tool_result", "image", "document"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list["_Block"] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint; no effect on the output


_Block.model_rebuild()


class _Message(_Request):
    role: Literal["user", "assistant"]
    content: str | list[_Block]


class _Tool(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class _ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class _Metadata(_Request):
    user_id: str | None = None


class _OutputFormat(_Request):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class _OutputConfig(_Request):
    format: _OutputFormat | None = None
    effort: None = None  # no reasoning effort to spend: any value is refused


class MessagesRequest(_Request):
    model: str | None = None
    max_tokens: int = Field(ge=1)
    messages: list[_Message] = Field(min_length=1)
    system: str | list[_Block] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stream: bool = False
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    metadata: _Metadata | None = None  # user_id: metadata only, as in Anthropic's API
    output_config: _OutputConfig | None = None  # format: structured output (a JSON schema)
    cache_control: dict[str, Any] | None = None  # a prompt-caching hint; no effect on the output


_UNSUPPORTED = {"image": "images are not supported", "document": "documents are not supported"}


def _unsupported(block: _Block, param: str) -> None:
    if block.type in _UNSUPPORTED:
        raise InvalidParameter(param, f"{param}: {_UNSUPPORTED[block.type]} (this server serves a text-only model)")


def _text(blocks: str | list[_Block] | None, param: str) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, b in enumerate(blocks):
        _unsupported(b, f"{param}.{j}")
    if any(b.type != "text" for b in blocks):
        raise InvalidParameter(param, f"{param} may only hold text blocks")
    return "".join(b.text or "" for b in blocks)


def _check_turns(messages: list[_Message]) -> None:
    """What Anthropic refuses before generating: empty content (the final assistant turn, a
    prefill, may be empty), and a tool_result whose tool_use_id names no tool_use of the assistant
    message right before it."""
    for i, m in enumerate(messages):
        empty = not m.content if isinstance(m.content, str) or not m.content else False
        if empty and not (m.role == "assistant" and i == len(messages) - 1):
            raise InvalidParameter(f"messages.{i}.content", f"messages.{i}: all messages must have non-empty "
                                                            "content except for the optional final assistant message")
        if isinstance(m.content, str):
            continue
        prev = messages[i - 1] if i > 0 else None
        uses = {b.id for b in prev.content if b.type == "tool_use"} if prev is not None and \
            prev.role == "assistant" and not isinstance(prev.content, str) else set()
        for j, b in enumerate(m.content):
            _unsupported(b, f"messages.{i}.content.{j}")
            if b.type == "tool_result" and b.tool_use_id not in uses:
                raise InvalidParameter(f"messages.{i}.content.{j}", f"messages.{i}.content.{j}: unexpected "
                                       f"`tool_use_id` found in `tool_result` blocks: {b.tool_use_id}. Each "
                                       "`tool_result` block must have a corresponding `tool_use` block in the "
                                       "previous message.")


def _call_id(tool_use_id: str | None) -> str | None:
    """The chat call id inside one of our tool_use ids (see _tool_use): templates may check its form
    (Mistral's demand 9 alphanumerics)."""
    return tool_use_id.removeprefix("toolu_") if tool_use_id else tool_use_id


def _openai_messages(req: MessagesRequest) -> list[dict]:
    _check_turns(req.messages)
    out: list[dict] = []
    if req.system:
        out.append({"role": "system", "content": _text(req.system, "system")})
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls = [], []
        for b in m.content:
            if b.type == "text":
                text.append(b.text or "")
            elif b.type == "tool_use" and m.role == "assistant":
                calls.append({"id": _call_id(b.id), "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input or {})}})
            elif b.type == "tool_result" and m.role == "user":
                # Each result is a tool message of its own, in order, as the OpenAI shape has them.
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = _text(b.content, f"messages.{i}.content")
                out.append({"role": "tool", "tool_call_id": _call_id(b.tool_use_id),
                            "content": f"Error: {result}" if b.is_error else result})
            else:
                raise InvalidParameter(f"messages.{i}.content", f"a {b.type} block cannot be in a {m.role} message")
        if text or calls or not out or out[-1]["role"] != "tool":
            msg: dict = {"role": m.role, "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    tool_choice: Any = None
    parallel = True
    if req.tool_choice is not None:
        tc = req.tool_choice
        parallel = not tc.disable_parallel_tool_use
        if tc.type == "tool":
            if not tc.name:
                raise InvalidParameter("tool_choice.name", "tool_choice of type tool needs a name")
            tool_choice = {"type": "function", "function": {"name": tc.name}}
        else:
            tool_choice = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
    tools_ = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                "parameters": t.input_schema}} for t in req.tools or []]
    fmt = req.output_config.format if req.output_config else None
    return ChatCompletionRequest(
        response_format={"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        if fmt else None,
        model=req.model, messages=_openai_messages(req), max_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences, stream=req.stream,
        tools=tools_ or None, tool_choice=tool_choice if tools_ or tool_choice == "none" else None,
        parallel_tool_calls=parallel)


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: Usage


def _stop(choice, has_calls: bool) -> tuple[str, str | None]:
    if choice.finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


def _tool_use(call: tools.ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": json.loads(call.arguments)}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


class AnthropicServing:
    def __init__(self, serving):
        self.serving = serving

    async def messages(self, req: MessagesRequest) -> MessageResponse | AsyncIterator[str]:
        job = await self.serving.start_chat(to_chat_request(req))
        msg_id = random_id("msg").replace("-", "_")
        if req.stream:
            return self._stream(job, msg_id)
        await self.serving.collect(job)
        (c,) = job.choices.values()
        message = self.serving.message(c)
        content = [{"type": "text", "text": message.content}] if message.content else []
        calls = c.tool_parser.calls if c.tool_parser else []
        content += [_tool_use(t) for t in calls]
        stop_reason, stop_sequence = _stop(c, bool(calls))
        usage = job.usage()
        return MessageResponse(id=msg_id, model=job.model, content=content, stop_reason=stop_reason,
                               stop_sequence=stop_sequence,
                               usage=Usage(input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens))

    async def _stream(self, job, msg_id: str) -> AsyncIterator[str]:
        """Text goes out as text_delta events in one text block; each tool call, once parsed, as a
        tool_use block whose input arrives in one input_json_delta."""
        (c,) = job.choices.values()
        index = 0
        text_open = False
        try:
            yield _event("message_start", {"type": "message_start", "message": {
                "id": msg_id, "type": "message", "role": "assistant", "model": job.model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": job.prompt_tokens, "output_tokens": 0}}})
            yield _event("ping", {"type": "ping"})
            async with contextlib.aclosing(job.handle.outputs()) as outputs:
                async for out in outputs:
                    job.apply(out)
                    text, calls = out.text, []
                    if c.tool_parser is not None:
                        text, calls = c.tool_parser.advance(out.text, out.finished)
                        if calls and not (text.strip() or text_open):
                            text = ""  # whitespace around calls is not a text block of its own
                    if text:
                        if not text_open:
                            yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": {"type": "text", "text": ""}})
                            text_open = True
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": "text_delta", "text": text}})
                    for call in calls:
                        if text_open:
                            yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                            index, text_open = index + 1, False
                        block = {**_tool_use(call), "input": {}}
                        yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                             "content_block": block})
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": "input_json_delta",
                                                                       "partial_json": call.arguments}})
                        yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                        index += 1
            if text_open:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            stop_reason, stop_sequence = _stop(c, bool(c.tool_parser and c.tool_parser.calls))
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                           "usage": {"output_tokens": c.num_output_tokens}})
            yield _event("message_stop", {"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream
            yield _event("error", error_for(e).anthropic_body())
        finally:
            job.handle.abort()
