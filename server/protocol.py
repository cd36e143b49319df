"""The OpenAI wire format: request and response bodies as pydantic models.

A request field this server does not know is refused (400 naming it), as the OpenAI API refuses an
unrecognized argument: a field accepted is a field honoured. `user` is the one field accepted
without effect on the output; it is metadata in OpenAI's API too. Fields are typed as strictly as
OpenAI types them: no "3" for an integer, no true for a token id, no Infinity for a float, and the
numeric ranges of engine.sampling_params.RANGES, which the OpenAPI schema shows too.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from engine.sampling_params import MAX_LOGPROBS, RANGES


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def sse(payload: BaseModel | str) -> str:
    """One server-sent event: a body as JSON (a chunk, or an error once the stream has started),
    or a literal such as [DONE]. The only place the event framing is written."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)


def _range(name: str, **kw) -> Any:
    """A Field with RANGES[name]'s bounds (the engine checks them too, for every entry point)."""
    lo, hi = RANGES[name]
    return Field(ge=lo, le=hi, **kw)


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path ("messages.0.content") of the first string in a request that holds a lone UTF-16
    surrogate (JSON allows "\\ud800"; no tokenizer can encode it), or None."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, BaseModel):
        items = [*((k, getattr(value, k)) for k in type(value).model_fields), *(value.model_extra or {}).items()]
    elif isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)):
        items = list(enumerate(value))
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _SURROGATE.search(key):
            return f"{path}.{key}".lstrip(".")
        found = lone_surrogate(item, f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the grammar always holds the output to the schema


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Request):
    """vLLM's `structured_outputs` object: exactly one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Sampling fields shared by both endpoints; the last four are vLLM's extensions."""

    model: str | None = None
    max_tokens: int | None = _range("max_tokens", default=None)
    temperature: float | None = _range("temperature", default=None)
    top_p: float | None = _range("top_p", default=None)
    n: int = _range("n", default=1)
    stop: str | list[str] | None = None
    seed: int | None = _range("seed", default=None)
    presence_penalty: float = _range("presence_penalty", default=0.0)
    frequency_penalty: float = _range("frequency_penalty", default=0.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = _range("min_p", default=None)
    repetition_penalty: float | None = _range("repetition_penalty", default=None)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's response_format, vLLM's guided_* fields and its newer
    # structured_outputs object; at most one of them per request.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsParams | None = None


# A prompt is a string, a list of strings, token ids, or a list of token-id lists.
Prompt = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    logprobs: int | None = _range("logprobs", default=None)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)


class TextPart(_Request):
    """A content part; only text parts are supported (no images, audio or files)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: str
    content: str | list[TextPart] | None = None


class FunctionDefinition(_Request):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # calls are constrained to the schema only with tool_choice required/named


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _range("max_tokens", default=None)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ToolCallInfo(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallInfo] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaToolCall(ToolCallInfo):
    index: int


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler):
        # OpenAI sends only the fields a delta carries: role in the first chunk, then content.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "layerstream"
    root: str | None = None  # a LoRA adapter's folder (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model: the served model's id (vLLM's field)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and unused: names identify adapters)."""

    lora_name: str
    lora_int_id: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
