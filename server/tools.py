"""Tool calling in OpenAI's shape: `tools` + `tool_choice` in, `message.tool_calls` (or streamed
`delta.tool_calls`) out, `role: "tool"` results accepted back.

- Prompt: the tools go to the chat template's own `tools` variable when the template uses one
  (Qwen2.5/3, Hermes, SmolLM3, Llama 3.1 ...). A template without tool support gets the tools
  described in a system message in the Hermes convention, and earlier calls and results rendered
  as text the same way, so the model still sees them.
- Output, tool_choice "auto": the model's text is scanned for Hermes-style
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the rest stays content. Models
  that write calls another way (Mistral's [TOOL_CALLS], Llama's bare JSON) are not parsed.
- tool_choice "required" or a named function: the grammar engine constrains the output (vLLM does
  the same): "required" to a JSON array of {"name", "arguments"} objects, one per call, each
  argument object valid for its function's schema; a named function to its arguments object. So
  the arguments always validate, whatever the model.
- "none": the tools are not shown to the model and nothing is parsed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from engine.sampling_params import InvalidParameter
from engine.structured_output import StructuredOutput, json_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"

_FALLBACK_PROMPT = (
    "You may call one or more functions to assist with the user query. The available tools, as JSON:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire format)
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict, ...] = ()  # OpenAI tool objects, as the template takes them
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def structured(self) -> StructuredOutput | None:
        """The grammar that makes the calls valid, for required / named."""
        schemas = {t["function"]["name"]: _parameters(t) for t in self.tools}
        if self.mode == "named":
            return json_schema(schemas[self.named], "tool_choice")
        if self.mode == "required":
            call = [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                     "required": ["name", "arguments"], "additionalProperties": False}
                    for name, schema in schemas.items()]
            array = {"type": "array", "items": {"anyOf": call}, "minItems": 1}
            if not self.parallel:
                array["maxItems"] = 1
            return json_schema(array, "tool_choice")
        return None

    def parser(self) -> "ToolCallParser":
        return ToolCallParser(self)


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def plan_tools(req) -> ToolPlan:
    """What tool calling this chat request asks for; InvalidParameter for inconsistent fields."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidParameter("tools", "tool function names must be unique")
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise InvalidParameter("tool_choice", "tool_choice needs tools")
        return ToolPlan("none")
    if choice in ("none", "auto", "required"):
        plan = ToolPlan(choice, tuple(tools) if choice != "none" else (), parallel=req.parallel_tool_calls)
    else:
        name = choice.function.name
        if name not in names:
            raise InvalidParameter("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        plan = ToolPlan("named", tuple(tools), named=name, parallel=req.parallel_tool_calls)
    return plan


def template_messages(messages: list[dict], plan: ToolPlan, native: bool) -> list[dict]:
    """Messages as the chat template should see them. Assistant calls carry their arguments as
    objects (templates print them with tojson); without native tool support the tools, calls and
    results are written into the text instead."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or []
        if m["role"] == "assistant" and calls:
            if native:
                m["tool_calls"] = [_with_object_arguments(c) for c in calls]
            else:
                text = "\n".join(OPEN + "\n" + json.dumps({"name": c["function"]["name"],
                                                           "arguments": _arguments(c)}) + "\n" + CLOSE
                                 for c in calls)
                m = {"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()}
        elif m["role"] == "tool" and not native:
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if plan.active and not native:
        prompt = _FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t) for t in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def check_messages(messages: list[dict]) -> None:
    for i, m in enumerate(messages):
        if m["role"] == "tool" and not m.get("tool_call_id"):
            raise InvalidParameter(f"messages.{i}.tool_call_id", "a tool message needs the tool_call_id it answers")
        for c in m.get("tool_calls") or []:
            if not isinstance(c, dict) or not isinstance(c.get("function"), dict) or "name" not in c["function"]:
                raise InvalidParameter(f"messages.{i}.tool_calls", "each tool call needs function.name and "
                                                                   "function.arguments")


def _arguments(call: dict):
    args = call["function"].get("arguments") or "{}"
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args


def _with_object_arguments(call: dict) -> dict:
    return {**call, "function": {**call["function"], "arguments": _arguments(call)}}


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back in a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """Turns generated text into content and tool calls, incrementally: `feed(delta)` returns the
    content that is safe to send now and the calls completed so far; `finish()` the rest."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def _add(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.plan.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls += calls
        return calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self.plan.mode != "auto":
            return "", []  # constrained output is all call: parsed whole at the end
        content, calls = "", []
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = _partial_prefix_len(self._buf, OPEN)
                    cut = len(self._buf) - keep
                    content, self._buf = content + self._buf[:cut], self._buf[cut:]
                    return content, self._add(calls)
                content, self._buf, self._in_call = content + self._buf[:i], self._buf[i + len(OPEN):], True
            else:
                j = self._buf.find(CLOSE)
                if j < 0:
                    return content, self._add(calls)
                body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(CLOSE):], False
                call = _parse_call(body)
                if call is None:
                    content += OPEN + body + CLOSE  # not a call after all: the model's text, as written
                else:
                    calls.append(call)

    def advance(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """One output delta in: the content to send now and the calls completed by it (all of
        what is left when `finished`)."""
        content, calls = self.feed(text)
        if finished:
            tail, more = self.finish()
            content, calls = content + tail, calls + more
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self.plan.mode == "named":
            try:
                json.loads(rest)
            except json.JSONDecodeError:
                return rest, []  # cut short (max_tokens): not a call
            return "", self._add([ToolCall(self.plan.named, rest)])
        if self.plan.mode == "required":
            try:
                items = json.loads(rest)
            except json.JSONDecodeError:
                return rest, []
            return "", self._add([ToolCall(c["name"], json.dumps(c["arguments"])) for c in items])
        if self._in_call:
            self._in_call = False
            call = _parse_call(rest)  # a model may end right after the JSON, without the closing tag
            if call is not None:
                return "", self._add([call])
            rest = OPEN + rest
        return rest, []


def finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    if parser is not None and parser.calls and reason == "stop":
        return "tool_calls"
    return reason
