"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes: a prompt (or chat messages, rendered
by the chat template exactly as /v1/chat/completions renders them) to token ids, and back."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from engine.sampling_params import InvalidParameter

from . import tools
from .protocol import ChatCompletionRequest, ChatMessage, ToolDefinition, _Request


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    return_token_strs: bool = False
    tools: list[ToolDefinition] | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int] = Field(min_length=0)


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(serving, req: TokenizeRequest) -> TokenizeResponse:
    serving.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise InvalidParameter("prompt", "send exactly one of prompt and messages")
    tok = serving.engine.tokenizer
    if req.prompt is not None:
        serving.check_text(req, "prompt", [req.prompt])  # a lone surrogate, a text that can never fit: 400
        if req.tools:
            raise InvalidParameter("tools", "tools go with messages, not with a prompt")
        ids = tok.encode(req.prompt, add_special_tokens=True if req.add_special_tokens is None
                         else req.add_special_tokens)
    else:
        if req.add_special_tokens:
            raise InvalidParameter("add_special_tokens", "the chat template writes special tokens itself")
        chat: Any = ChatCompletionRequest(messages=req.messages, tools=req.tools,
                                          add_generation_prompt=req.add_generation_prompt)
        ids = serving.chat_prompt_ids(chat, tools.plan_tools(chat, serving.tool_format()))
    strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.engine.max_model_len, tokens=ids, token_strs=strs)


def detokenize(serving, req: DetokenizeRequest) -> DetokenizeResponse:
    serving.check_model(req.model)
    vocab = serving.engine.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidParameter("tokens", f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
    return DetokenizeResponse(prompt=serving.engine.tokenizer.decode(req.tokens))
