"""Tool calling in OpenAI's shape: `tools` + `tool_choice` in, `message.tool_calls` (or streamed
`delta.tool_calls`) out, `role: "tool"` results accepted back.

- Prompt: the tools go to the chat template's own `tools` variable when the template uses one
  (Qwen2.5/3, Hermes, SmolLM3, Llama 3.1 ...). A template without tool support gets the tools
  described in a system message in the Hermes convention, and earlier calls and results rendered
  as text the same way, so the model still sees them.
- Output, tool_choice "auto": the model's text is scanned for calls in the format its chat template
  teaches (`--tool-call-parser`, vLLM's names; `auto` reads the template): `hermes`
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`: Qwen2/2.5/3, Hermes, SmolLM3, and the
  fallback prompt below), `llama3_json` (Llama 3.1-3.3: a bare `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`) and `mistral` (`[TOOL_CALLS]` then a
  JSON array of `{"name", "arguments"}`, or v11's `name[ARGS]{...}`). The rest stays content.
- tool_choice "required" or a named function: the grammar engine constrains the output (vLLM does
  the same): "required" to a JSON array of {"name", "arguments"} objects, one per call, each
  argument object valid for its function's schema; a named function to its arguments object. So
  the arguments always validate, whatever the model.
- "none": the tools are not shown to the model and nothing is parsed.
- Whatever tool_choice, each function's `parameters` must be a JSON schema the grammar engine reads
  (`ToolPlan.schemas()`; unknown keywords aside): `{"type": "banana"}` is a 400, not a tool the
  model is told about.
- Cut short by max_tokens, a forced call ("required", named) is never returned as content: the
  calls completed so far are returned, an incomplete one is dropped, and finish_reason is "length"
  (so a named call cut short returns no call at all). Reserve tokens with max_tokens to avoid it.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from engine.sampling_params import InvalidParameter
from engine.structured_output import StructuredOutput, json_schema

OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1+: starts a tool call (a special token, kept in the text for parsing)
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"

FORMATS = ("hermes", "llama3_json", "mistral")
PARSER_CHOICES = ("auto", *FORMATS)  # --tool-call-parser


def format_for(choice: str, chat_template: str | None) -> str:
    """The tool-call format to parse: the --tool-call-parser choice, or for "auto" the one the chat
    template teaches (a template without tools gets the Hermes fallback prompt)."""
    if choice != "auto":
        if choice not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {PARSER_CHOICES}, got {choice!r}")
        return choice
    template = chat_template or ""
    if MISTRAL_CALLS in template:
        return "mistral"
    if OPEN in template or "tools" not in template:
        return "hermes"
    if PYTHON_TAG in template or '"parameters"' in template:
        return "llama3_json"
    return "hermes"

_FALLBACK_PROMPT = (
    "You may call one or more functions to assist with the user query. The available tools, as JSON:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>"
)


def call_id(fmt: str = "hermes") -> str:
    # Mistral's chat templates refuse any tool call id but 9 alphanumerics, and clients send our
    # ids back in the next request's messages.
    return uuid.uuid4().hex[:9] if fmt == "mistral" else "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's wire format)
    id: str = field(default_factory=call_id)

    def openai(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: tuple[dict, ...] = ()  # OpenAI tool objects, as the template takes them
    named: str | None = None
    parallel: bool = True
    format: str = "hermes"  # how the model writes calls (FORMATS)
    declared: tuple[dict, ...] = ()  # every tool the request sent (with "none" too), for schemas()

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must be decoded with special tokens: Mistral's [TOOL_CALLS] and
        Llama's <|python_tag|> are special tokens, which decoding would otherwise drop."""
        return self.mode == "auto" and self.format in ("mistral", "llama3_json")

    @property
    def forced(self) -> bool:
        """The output is calls only (required, named): the grammar holds it to them."""
        return self.mode in ("required", "named")

    def schemas(self) -> list[StructuredOutput]:
        """Every function's parameters as a constraint to check (leniently: they are only checked
        here, the forced grammar of structured() enforces them), naming the field in errors."""
        return [json_schema(_parameters(t), f"tools.{i}.function.parameters", lenient=True)
                for i, t in enumerate(self.declared)]

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


def plan_tools(req, fmt: str = "hermes") -> ToolPlan:
    """What tool calling this chat request asks for, parsed in format `fmt`; InvalidParameter for
    inconsistent fields."""
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
        plan = ToolPlan(choice, tuple(tools) if choice != "none" else (), parallel=req.parallel_tool_calls, format=fmt,
                        declared=tuple(tools))
    else:
        name = choice.function.name
        if name not in names:
            raise InvalidParameter("tool_choice", f"tool_choice names {name!r}, which is not in tools")
        plan = ToolPlan("named", tuple(tools), named=name, parallel=req.parallel_tool_calls, format=fmt,
                        declared=tuple(tools))
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


def _call_from(obj, fmt: str) -> ToolCall | None:
    """A decoded JSON value as a call: {"name": str, "arguments" (or Llama's "parameters"): ...}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args), call_id(fmt))


def _parse_call(body: str, fmt: str = "hermes") -> ToolCall | None:
    try:
        return _call_from(json.loads(body), fmt)
    except json.JSONDecodeError:
        return None


_DECODER = json.JSONDecoder()


def _decode_prefix(text: str):
    """(value, characters used) of the JSON value text starts with; None while it is incomplete
    or not JSON."""
    try:
        return _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        return None


def _complete_items(text: str) -> list:
    """The whole items of a JSON array, also when max_tokens cut it short after some of them (a
    weak model held to "required" may keep adding calls until then)."""
    body = text.lstrip()
    if not body.startswith("["):
        return []
    items, body = [], body[1:]
    while True:
        body = body.lstrip().removeprefix(",").lstrip()
        decoded = _decode_prefix(body)
        if decoded is None:
            return items
        items.append(decoded[0])
        body = body[decoded[1]:]


def _partial_prefix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag (held back in a stream)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _MarkerScanner(ABC):
    """Content until a marker that opens a call; `_after_marker` parses what follows it."""

    marker = ""

    def __init__(self):
        self._buf, self._in_call = "", False

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = "", []
        while True:
            if not self._in_call:
                before, found = self._content_until_marker()
                content += before
                if not found:
                    return content, calls
            done = self._after_marker()
            if done is None:
                return content, calls  # incomplete: wait for more text
            content, calls = content + done[0], calls + done[1]

    def _content_until_marker(self) -> tuple[str, bool]:
        """The content before the next marker (a partial marker at the end is held back, it may
        complete in the next delta), and whether one came: the buffer then starts right after it."""
        i = self._buf.find(self.marker)
        if i < 0:
            cut = len(self._buf) - _partial_prefix_len(self._buf, self.marker)
            content, self._buf = self._buf[:cut], self._buf[cut:]
            return content, False
        content, self._buf, self._in_call = self._buf[:i], self._buf[i + len(self.marker):], True
        return content, True

    @abstractmethod
    def _after_marker(self) -> tuple[str, list[ToolCall]] | None:
        """Parse the buffer after a marker: (content, calls) once decided (leaving the call),
        None while incomplete."""


class _HermesScanner(_MarkerScanner):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the text."""

    marker = OPEN

    def _after_marker(self) -> tuple[str, list[ToolCall]] | None:
        j = self._buf.find(CLOSE)
        if j < 0:
            return None
        body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(CLOSE):], False
        call = _parse_call(body)
        # Not a call after all: the model's text, as written.
        return (OPEN + body + CLOSE, []) if call is None else ("", [call])

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            call = _parse_call(rest)  # a model may end right after the JSON, without the closing tag
            if call is not None:
                return "", [call]
            rest = OPEN + rest
        return rest, []


class _Llama3JsonScanner:
    """Llama 3.x: the whole answer is the calls when it starts with `<|python_tag|>` or `{`: JSON
    objects separated by `;`. Anything else is content."""

    def __init__(self):
        self._buf, self._state = "", "start"  # start (undecided) | calls | content

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if self._state == "start":
            head = self._buf.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return "", []  # cannot tell yet
            self._state = "calls" if head.startswith((PYTHON_TAG, "{")) else "content"
        if self._state == "content":
            out, self._buf = self._buf, ""
            return out, []
        calls = []
        while True:
            body = self._buf.lstrip()
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):].lstrip()
            body = body.lstrip("; \n")
            decoded = _decode_prefix(body)
            if decoded is None:
                return "", calls  # incomplete: wait (finish() decides)
            call = _call_from(decoded[0], "llama3_json")
            if call is None:
                self._state = "content"  # JSON, but not a call: the model's text
                out, self._buf = self._buf, ""
                return out, calls
            calls.append(call)
            self._buf = body[decoded[1]:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        return ("" if self._state == "calls" and not rest.strip(" ;\n") else rest), []


class _MistralScanner(_MarkerScanner):
    """Mistral: content, then `[TOOL_CALLS]` followed by a JSON array of {"name", "arguments"}
    (tokenizers up to v7) or by `name[ARGS]{...}` (v11 on), one `[TOOL_CALLS]` per call."""

    marker = MISTRAL_CALLS

    def _after_marker(self) -> tuple[str, list[ToolCall]] | None:
        parsed = self._parse(self._buf.lstrip())
        if parsed is None:
            return None
        found, rest = parsed
        self._in_call = False
        if not found:
            return MISTRAL_CALLS, []  # not a call after all: the model's text, as written
        self._buf = rest
        return "", found

    @staticmethod
    def _parse(body: str) -> tuple[list[ToolCall], str] | None:
        """(calls, text after them), ([], body) if body is no call, None while incomplete."""
        if not body:
            return None
        if body.startswith("["):
            decoded = _decode_prefix(body)
            if decoded is None:
                return None
            calls = [_call_from(o, "mistral") for o in decoded[0]] if isinstance(decoded[0], list) else [None]
            return ([], body) if None in calls or not calls else (calls, body[decoded[1]:])
        name_end = min((i for i in (body.find(MISTRAL_ARGS), body.find("{")) if i >= 0), default=-1)
        if name_end < 0:
            return None if len(body) < 80 else ([], body)
        name = body[:name_end].strip()
        args = body[name_end:]
        if args.startswith(MISTRAL_ARGS):
            args = args[len(MISTRAL_ARGS):]
        decoded = _decode_prefix(args)
        if decoded is None:
            return None
        if not name.replace("_", "").replace("-", "").isalnum() or not isinstance(decoded[0], dict):
            return [], body
        return [ToolCall(name, json.dumps(decoded[0]), call_id("mistral"))], args[decoded[1]:]

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            rest = MISTRAL_CALLS + rest  # cut short: the model's text, as written
        return rest, []


_SCANNERS = {"hermes": _HermesScanner, "llama3_json": _Llama3JsonScanner, "mistral": _MistralScanner}


class ToolCallParser:
    """Turns generated text into content and tool calls, incrementally: `feed(delta)` returns the
    content that is safe to send now and the calls completed so far; `finish()` the rest."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self._buf = ""  # required / named: the whole (grammar-constrained) output
        self._scanner = _SCANNERS[plan.format]()
        self.calls: list[ToolCall] = []

    def _add(self, calls: list[ToolCall]) -> list[ToolCall]:
        if not self.plan.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls += calls
        return calls

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self.plan.mode != "auto":
            self._buf += text
            return "", []  # constrained output is all call: parsed whole at the end
        content, calls = self._scanner.feed(text)
        return content, self._add(calls)

    def advance(self, text: str, finished: bool) -> tuple[str, list[ToolCall]]:
        """One output delta in: the content to send now and the calls completed by it (all of
        what is left when `finished`)."""
        content, calls = self.feed(text)
        if finished:
            tail, more = self.finish()
            content, calls = content + tail, calls + more
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        fmt = self.plan.format
        if self.plan.mode == "named":
            rest, self._buf = self._buf, ""
            try:
                json.loads(rest)
            except json.JSONDecodeError:
                return "", []  # cut short (max_tokens): the incomplete call is dropped, never content
            return "", self._add([ToolCall(self.plan.named, rest, call_id(fmt))])
        if self.plan.mode == "required":
            rest, self._buf = self._buf, ""
            # Cut short (max_tokens): the whole calls so far; the incomplete one is dropped.
            items = _complete_items(rest)
            return "", self._add([ToolCall(c["name"], json.dumps(c["arguments"]), call_id(fmt)) for c in items])
        content, calls = self._scanner.finish()
        return content, self._add(calls)


def finish_reason(reason: str | None, parser: ToolCallParser | None) -> str | None:
    if parser is not None and parser.calls and reason == "stop":
        return "tool_calls"
    return reason
