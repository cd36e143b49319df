"""The agent-facing API end to end, through the official openai and anthropic clients against a real
`layerstream serve` subprocess: structured output, tool calls, logit_bias, echo, models by id,
tokenize / detokenize, vLLM metric names, the Messages API, and 400s naming the field.

The model has random weights: only the grammar makes its JSON valid and its tool calls parse. Its
chat template reads `tools` (Hermes style), so the native tool path is the one served here; the
fallback for templates without tools is checked on the demo template directly.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import jsonschema
import pytest
from transformers import AutoTokenizer, LlamaConfig

from engine.demo import CHAT_TEMPLATE, build_random_model
from server import tools as tool_calls
from tests.support.server import Server, start_server, stop_server, assert_error
from tests.support.structured import SCHEMA

TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|system|>\n{{ messages[0]['content'] }}<|end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}<|assistant|>\n"
    "{% for tc in message['tool_calls'] %}<tool_call>\n"
    "{\"name\": \"{{ tc['function']['name'] }}\", \"arguments\": {{ tc['function']['arguments'] | tojson }}}\n"
    "</tool_call>{% endfor %}<|end|>\n"
    "{%- elif message['role'] == 'tool' %}<|user|>\n<tool_response>\n{{ message['content'] }}\n</tool_response><|end|>\n"
    "{%- else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}},
                                       "required": ["tz"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


@pytest.fixture(scope="module")
def api_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    folder = build_random_model(root / "model", cfg, seed=16)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(folder)
    s = start_server(root, "api", ["--model", str(folder), "--served-model-name", "agent", "--max-model-len", "2048"],
                     {})
    s.model, s.folder = "agent", folder
    yield s
    stop_server(s)


def ask(n: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe animal number {n} as JSON."}]


# -- structured output ------------------------------------------------------------------------

def test_json_schema_twenty_requests_streamed_and_not(api_server):
    """20 concurrent chat requests (10 streamed) with a nested schema: every output validates."""
    client = api_server.async_client()
    fmt = {"type": "json_schema", "json_schema": {"name": "animal", "schema": SCHEMA, "strict": True}}

    async def one(i: int) -> tuple[str, str]:
        kw = dict(model="agent", messages=ask(i), response_format=fmt, max_tokens=200, seed=i)
        if i % 2:
            text, reason = "", None
            async for ch in await client.chat.completions.create(stream=True, **kw):
                text += ch.choices[0].delta.content or ""
                reason = ch.choices[0].finish_reason or reason
            return text, reason
        r = await client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    async def run():
        return await asyncio.gather(*(one(i) for i in range(20)))

    results = asyncio.run(run())
    for text, reason in results:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({t for t, _ in results}) > 1  # seeded differently: really sampled, not one canned answer


def test_vllm_structured_extensions(api_server):
    c = api_server.client()
    r = c.completions.create(model="agent", prompt="Pick:", max_tokens=20, extra_body={"guided_choice": ["red", "blue"]})
    assert r.choices[0].text in ("red", "blue")
    r = c.completions.create(model="agent", prompt="Code:", max_tokens=20, extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text[:2].isupper() and r.choices[0].text[2:].isdigit()
    r = c.completions.create(model="agent", prompt="x", max_tokens=200, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = c.completions.create(model="agent", prompt="x", max_tokens=20,
                             extra_body={"structured_outputs": {"grammar": 'start: "on" | "off"'}})
    assert r.choices[0].text in ("on", "off")
    r = c.chat.completions.create(model="agent", messages=ask(1), max_tokens=300, temperature=0.7, seed=3,
                                  response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # an unbounded object may run out of tokens; what came out is still a JSON prefix
        assert r.choices[0].message.content.startswith("{")


def test_structured_output_errors(api_server):
    url = api_server.url + "/v1/chat/completions"
    base = {"model": "agent", "messages": ask(0), "max_tokens": 5}
    assert_error(httpx.post(url, json={**base, "guided_regex": "[a-"}), 400, "guided_regex")
    assert_error(httpx.post(url, json={**base, "guided_grammar": "start: nowhere"}), 400, "guided_grammar")
    assert_error(httpx.post(url, json={**base, "response_format": {"type": "json_object"}, "guided_regex": "a"}),
                 400, "guided_regex")
    assert_error(httpx.post(url, json={**base, "response_format": {"type": "json_schema"}}), 400, "response_format")
    assert_error(httpx.post(url, json={**base, "structured_outputs": {"regex": "a", "choice": ["b"]}}),
                 400, "structured_outputs")


# -- tools ------------------------------------------------------------------------------------

def test_tool_choice_required_and_round_trip(api_server):
    c = api_server.client()
    r = c.chat.completions.create(model="agent", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                  tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=300, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    call = choice.message.tool_calls[0]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    # The template sees the call's arguments as an object and the tool's answer.
    prompt = httpx.post(api_server.url + "/detokenize", json={"tokens": httpx.post(
        api_server.url + "/tokenize", json={"messages": history, "tools": [WEATHER, CLOCK]}).json()["tokens"]}).json()
    args = json.loads(call.function.arguments)
    assert f'"arguments": {json.dumps(args)}' in prompt["prompt"] and "21 degrees" in prompt["prompt"]
    r = c.chat.completions.create(model="agent", messages=history, tools=[WEATHER, CLOCK], max_tokens=8,
                                  extra_body={"ignore_eos": True}, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content


def test_named_tool_streamed(api_server):
    c = api_server.client()
    kw = dict(model="agent", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, CLOCK],
              tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=50, seed=2)
    chunks = list(c.chat.completions.create(stream=True, **kw))
    calls = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_time" and calls[0].index == 0
    assert json.loads(calls[0].function.arguments) in ({"tz": "utc"}, {"tz": "cet"})
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    whole = c.chat.completions.create(**kw)
    assert whole.choices[0].message.tool_calls[0].function.arguments == calls[0].function.arguments


def test_tool_call_parser_flag_end_to_end(api_server, tmp_path):
    """`--tool-call-parser mistral` on a model whose template teaches Hermes tags: the flag wins.
    The random model is held to Mistral's call text by guided_choice (allowed beside tool_choice
    auto), and the calls come back parsed, whole and streamed, with 9-character ids that the
    next request may send back."""
    s = start_server(tmp_path, "mistral", ["--model", str(api_server.folder), "--served-model-name", "agent",
                                           "--max-model-len", "2048", "--tool-call-parser", "mistral"], {})
    try:
        c = s.client()
        said = 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]'
        kw = dict(model="agent", messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=[WEATHER, CLOCK],
                  max_tokens=200, extra_body={"guided_choice": [said]})
        r = c.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo",
                                                                                               "unit": "c"}
        assert len(call.id) == 9 and call.id.isalnum()
        chunks = list(c.chat.completions.create(stream=True, **kw))
        streamed = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        content = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        assert content == "Checking." and [tc.function.arguments for tc in streamed] == [call.function.arguments]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        history = [*kw["messages"], {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "cold"}]
        r = c.chat.completions.create(model="agent", messages=history, tools=[WEATHER, CLOCK], max_tokens=4)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        stop_server(s)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_cut_short_is_never_content(api_server, tool_choice):
    """max_tokens 3 cuts a forced call short: the incomplete call is dropped, never sent as
    content; finish_reason "length". Streamed and not."""
    c = api_server.client()
    kw = dict(model="agent", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER, CLOCK],
              tool_choice=tool_choice, max_tokens=3, seed=1)
    r = c.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "length" and r.usage.completion_tokens == 3
    assert choice.message.content is None and choice.message.tool_calls is None
    chunks = list(c.chat.completions.create(stream=True, **kw))
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert not any(ch.choices[0].delta.tool_calls for ch in chunks if ch.choices)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
def test_invalid_tool_schema_is_a_400_whatever_tool_choice(api_server, tool_choice):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "banana"}}}
    body = {"model": "agent", "messages": ask(0), "max_tokens": 2, "tools": [WEATHER, bad]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    assert_error(httpx.post(api_server.url + "/v1/chat/completions", json=body), 400,
                 "tools.1.function.parameters", "banana")


def test_grammar_too_costly_while_generating_ends_that_request(api_server):
    """The issue's counted regex, which compiles in a millisecond: once following it goes past the
    grammar engine's limits (a few tokens in), the request ends with a 400 naming the field (not
    streamed) or an error event then [DONE] (streamed)."""
    body = {"model": "agent", "prompt": "x", "max_tokens": 50, "ignore_eos": True, "temperature": 0,
            "guided_regex": "(q{20000}){20000}"}
    url = api_server.url + "/v1/completions"
    assert_error(httpx.post(url, json=body, timeout=120), 400, "guided_regex", "the request was ended")
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["param"] == "guided_regex" and error["code"] == 400, error
    assert all("choices" in json.loads(e) for e in events[:-2])


def test_tool_errors(api_server):
    url = api_server.url + "/v1/chat/completions"
    base = {"model": "agent", "messages": ask(0), "max_tokens": 5}
    assert_error(httpx.post(url, json={**base, "tool_choice": "required"}), 400, "tool_choice")
    assert_error(httpx.post(url, json={**base, "tools": [WEATHER], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}), 400, "tool_choice")
    assert_error(httpx.post(url, json={**base, "messages": [{"role": "tool", "content": "x"}]}), 400,
                 "messages.0.tool_call_id")
    assert_error(httpx.post(url, json={**base, "tools": [WEATHER], "tool_choice": "required",
                                       "response_format": {"type": "json_object"}}), 400, "response_format")


def test_auto_tool_calls_parsed_incrementally():
    """tool_choice auto: Hermes-style calls are cut out of the text, also when a tag is split across
    stream deltas; text that only looks like a call stays content."""
    plan = tool_calls.ToolPlan("auto", (WEATHER,))
    text = 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'
    p = plan.parser()
    out, calls = "", []
    for i in range(0, len(text), 3):
        delta, new = p.feed(text[i:i + 3])
        out, calls = out + delta, calls + new
        assert "<" not in out
    tail, new = p.finish()
    assert out + tail == "Sure." and len(calls + new) == 1
    assert json.loads(calls[0].arguments) == {"city": "Oslo", "unit": "c"}
    p = plan.parser()
    assert p.feed("a <tool_call>not json</tool_call> b") == ("a <tool_call>not json</tool_call> b", [])


def _parse_in_pieces(plan, text: str, size: int = 3):
    """Content and calls from `text` fed in `size`-character stream deltas."""
    p, out, calls = plan.parser(), "", []
    for i in range(0, len(text), size):
        delta, new = p.feed(text[i:i + size])
        out, calls = out + delta, calls + new
    tail, new = p.finish()
    return out + tail, calls + new


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_llama3_json_tool_calls(size):
    """Llama 3.x writes a bare JSON object with "parameters" (or after <|python_tag|>, several
    separated by ';'); anything else, and JSON that is no call, stays content."""
    plan = tool_calls.ToolPlan("auto", (WEATHER, CLOCK), format="llama3_json")
    text = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "c"}}'
    out, calls = _parse_in_pieces(plan, text, size)
    assert out == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]
    text = '<|python_tag|>{"name": "get_time", "parameters": {"tz": "utc"}}; {"name": "get_time", "parameters": {"tz": "cet"}}'
    out, calls = _parse_in_pieces(plan, text, size)
    assert out == "" and [json.loads(c.arguments)["tz"] for c in calls] == ["utc", "cet"]
    assert _parse_in_pieces(plan, "The weather is {fine}.", size) == ("The weather is {fine}.", [])
    assert _parse_in_pieces(plan, '{"answer": 42}', size) == ('{"answer": 42}', [])
    assert _parse_in_pieces(plan, '{"name": "get_ti', size) == ('{"name": "get_ti', [])  # cut short


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_mistral_tool_calls(size):
    """Mistral: content, then [TOOL_CALLS] with a JSON array (v3 tokenizers) or name[ARGS]{...}
    (v11); ids are 9 alphanumerics, which Mistral's templates demand when the calls come back."""
    plan = tool_calls.ToolPlan("auto", (WEATHER, CLOCK), format="mistral")
    text = 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}, ' \
           '{"name": "get_time", "arguments": {"tz": "utc"}}]'
    out, calls = _parse_in_pieces(plan, text, size)
    assert out == "Let me check." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    out, calls = _parse_in_pieces(plan, '[TOOL_CALLS]get_time[ARGS]{"tz": "cet"}[TOOL_CALLS]get_weather[ARGS]'
                                        '{"city": "Rome", "unit": "f"}', size)
    assert out == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_time", {"tz": "cet"}), ("get_weather", {"city": "Rome", "unit": "f"})]
    assert _parse_in_pieces(plan, "[TOOL_CALLS] is a token; [1, 2]", size) == ("[TOOL_CALLS] is a token; [1, 2]", [])
    assert _parse_in_pieces(plan, '[TOOL_CALLS][{"name": "get_t', size) == ('[TOOL_CALLS][{"name": "get_t', [])


def test_required_calls_cut_short_keep_the_whole_ones():
    """tool_choice required: a model may keep adding calls until max_tokens; the whole ones are
    returned, the cut one dropped (finish_reason stays "length")."""
    plan = tool_calls.ToolPlan("required", (WEATHER, CLOCK))
    text = '[{"name": "get_time", "arguments": {"tz": "utc"}}, {"name": "get_weather", "arguments": {"city": "Os'
    out, calls = _parse_in_pieces(plan, text)
    assert out == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "utc"})]
    assert tool_calls.finish_reason("length", _parser_with(plan, text)) == "length"
    assert _parse_in_pieces(plan, '[{"name": "get_ti') == ("", [])  # never content


def _parser_with(plan, text):
    p = plan.parser()
    p.advance(text, finished=True)
    return p


def test_tool_call_format_follows_the_template_or_the_flag():
    llama31 = ('{%- if tools %}Given the following functions, please respond with a JSON for a function call '
               'with its proper arguments. Respond in the format {"name": function name, "parameters": '
               'dictionary of argument name and its value}.{% endif %}<|python_tag|>')
    mistral = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]"
    qwen = "{%- if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>{% endif %}<tool_call>"
    assert [tool_calls.format_for("auto", t) for t in (llama31, mistral, qwen, CHAT_TEMPLATE, None)] == [
        "llama3_json", "mistral", "hermes", "hermes", "hermes"]
    assert tool_calls.format_for("mistral", qwen) == "mistral"
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_calls.format_for("pythonic", qwen)
    # Their markers are special tokens, which must stay in the decoded text to be parsed.
    assert tool_calls.ToolPlan("auto", (WEATHER,), format="mistral").keeps_special_tokens
    assert not tool_calls.ToolPlan("auto", (WEATHER,), format="hermes").keeps_special_tokens
    assert not tool_calls.ToolPlan("required", (WEATHER,), format="llama3_json").keeps_special_tokens


def test_tools_without_template_support_go_into_the_prompt():
    plan = tool_calls.ToolPlan("auto", (WEATHER,))
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "cold"}]
    out = tool_calls.template_messages(msgs, plan, native=False)
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"]
    assert '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}' in out[2]["content"]
    assert out[3] == {"role": "user", "content": "<tool_response>\ncold\n</tool_response>"}
    assert "tools" not in CHAT_TEMPLATE  # the demo template is one such template


# -- logit_bias, echo, validation ---------------------------------------------------------------

def test_logit_bias_forcing_eos(api_server):
    tok = httpx.post(api_server.url + "/tokenize", json={"prompt": "<|endoftext|>"}).json()["tokens"]
    eos = tok[-1]
    r = api_server.client().chat.completions.create(model="agent", messages=ask(0), max_tokens=20,
                                                     logit_bias={str(eos): 100})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize("body,param", [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"functions": []}, "functions"),  # a field this server would not honour is refused, never ignored
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"n": 0}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream it would do nothing
])
def test_out_of_range_is_400_with_param(api_server, body, param):
    r = httpx.post(api_server.url + "/v1/chat/completions", json={"model": "agent", "messages": ask(0), **body})
    assert_error(r, 400, param)
    with pytest.raises(Exception) as e:  # and the openai client surfaces it as a BadRequestError
        api_server.client().chat.completions.create(model="agent", messages=ask(0), max_tokens=2, extra_body=body)
    assert getattr(e.value, "status_code", None) == 400


def test_echo_is_prompt_plus_completion(api_server):
    c = api_server.client()
    prompt = "  Once upon a time  "
    plain = c.completions.create(model="agent", prompt=prompt, max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True})
    echoed = c.completions.create(model="agent", prompt=prompt, max_tokens=6, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="agent", prompt=prompt, max_tokens=6, temperature=0, echo=True, stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == echoed.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(api_server):
    """echo + logprobs: the prompt's tokens come first, the first with a null logprob (as OpenAI
    sends it), the others scored as transformers scores them on the same weights; then the
    completion's tokens. Streamed, the first chunk carries the same prompt part."""
    import torch
    from transformers import AutoModelForCausalLM

    c = api_server.client()
    prompt = "The cat sat on the mat because"
    ids = httpx.post(api_server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    model = AutoModelForCausalLM.from_pretrained(api_server.folder, dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)  # (tokens, vocab)
    r = c.completions.create(model="agent", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2,
                             extra_body={"ignore_eos": True})
    lp, n = r.choices[0].logprobs, len(ids)
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == n + 4 and len(lp.token_logprobs) == n + 4 and len(lp.text_offset) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = [float(ref[i, ids[i + 1]]) for i in range(n - 1)]
    assert lp.token_logprobs[1:n] == pytest.approx(expected, abs=1e-4)
    for i in range(1, n):  # the alternatives (keyed by text: two ids may share one): the reference's best
        assert max(lp.top_logprobs[i].values()) == pytest.approx(float(ref[i - 1].max()), abs=1e-4)
    tok = AutoTokenizer.from_pretrained(api_server.folder)
    assert lp.tokens[:n] == [tok.decode([t]) for t in ids]
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    plain = c.completions.create(model="agent", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True}).choices[0].logprobs
    assert lp.tokens[n:] == plain.tokens and lp.token_logprobs[n:] == pytest.approx(plain.token_logprobs)
    chunks = list(c.completions.create(model="agent", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and first.token_logprobs[1:n] == pytest.approx(expected, abs=1e-4)
    assert sum(len(ch.choices[0].logprobs.tokens) for ch in chunks if ch.choices) == n + 4


# -- small endpoints ----------------------------------------------------------------------------

def test_model_by_id_tokenize_detokenize_and_vllm_metrics(api_server):
    c = api_server.client()
    assert c.models.retrieve("agent").id == "agent"
    assert_error(httpx.get(api_server.url + "/v1/models/other"), 404, "model")
    tok = httpx.post(api_server.url + "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) and tok["max_model_len"] == 2048
    assert httpx.post(api_server.url + "/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": "Hello world"}
    chat = httpx.post(api_server.url + "/tokenize", json={"messages": ask(3)}).json()
    r = c.chat.completions.create(model="agent", messages=ask(3), max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens
    assert_error(httpx.post(api_server.url + "/detokenize", json={"tokens": [512]}), 400, "tokens")
    assert_error(httpx.post(api_server.url + "/tokenize", json={}), 400, "prompt")
    text = httpx.get(api_server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:generation_tokens_total", "layerstream_structured_output_mask_seconds"):
        assert f"{name}{{" in text, name


# -- Anthropic Messages API ---------------------------------------------------------------------

def _anthropic(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)


def test_messages_api(api_server):
    a = _anthropic(api_server)
    kw = dict(model="agent", max_tokens=10, system="You are terse.", extra_body={"temperature": 0},
              messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                        {"role": "user", "content": [{"type": "text", "text": "Tell a story."}]}])
    m = a.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.model == "agent"
    assert m.stop_reason in ("end_turn", "max_tokens") and m.usage.input_tokens > 0
    text = m.content[0].text if m.content else ""
    with a.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens
    # max_tokens and stop sequences map onto Anthropic's stop reasons.
    long = a.messages.create(model="agent", max_tokens=30, extra_body={"temperature": 0}, messages=kw["messages"])
    assert long.stop_reason == "max_tokens" and len(long.content[0].text) > 4  # greedy on these weights
    stop = long.content[0].text[2:4]
    cut = a.messages.create(model="agent", max_tokens=30, extra_body={"temperature": 0}, messages=kw["messages"],
                            stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == long.content[0].text[:long.content[0].text.index(stop)]


def test_messages_api_tool_use(api_server):
    a = _anthropic(api_server)
    tool = {"name": "get_weather", "description": "weather", "input_schema": SCHEMAS["get_weather"]}
    m = a.messages.create(model="agent", max_tokens=100, tools=[tool],
                          tool_choice={"type": "any", "disable_parallel_tool_use": True},
                          messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert m.stop_reason == "tool_use"
    use = [b for b in m.content if b.type == "tool_use"][0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMAS["get_weather"])
    follow = [{"role": "user", "content": "Weather in Oslo?"},
              {"role": "assistant", "content": [use.model_dump()]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "cold"}]}]
    with a.messages.stream(model="agent", max_tokens=60, tools=[tool], messages=follow,
                           tool_choice={"type": "tool", "name": "get_weather"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use"
    jsonschema.validate(final.content[-1].input, SCHEMAS["get_weather"])


def test_messages_api_structured_output(api_server):
    m = _anthropic(api_server).messages.create(
        model="agent", max_tokens=200, messages=[{"role": "user", "content": "An animal, as JSON"}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), SCHEMA)


def test_messages_api_errors(api_server):
    a = _anthropic(api_server)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model="agent", max_tokens=10, extra_body={"temperature": 1.5},
                          messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "invalid_request_error" and "temperature" in str(e.value)
    with pytest.raises(anthropic.NotFoundError):
        a.messages.create(model="other", max_tokens=10, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(api_server.url + "/v1/messages", json={"model": "agent", "messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"


@pytest.mark.parametrize("messages, where, says", [
    # A tool_result that answers no tool_use of the assistant message just before it.
    ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "cold"}]}],
     "messages.0.content.0", "tool_use_id"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "cold"}]}],
     "messages.2.content.0", "tool_use_id"),
    ([{"role": "user", "content": ""}], "messages.0.content", "non-empty content"),
    ([{"role": "user", "content": []}], "messages.0.content", "non-empty content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "x"}],
     "messages.1.content", "non-empty content"),
    ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                 "data": "iVBORw0KGgo="}}]}],
     "messages.0.content.0", "images are not supported"),
    ([{"role": "user", "content": [{"type": "text", "text": "read this"},
                                   {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                                                   "data": "hello"}}]}],
     "messages.0.content.1", "documents are not supported"),
])
def test_messages_api_refuses_what_anthropic_refuses(api_server, messages, where, says):
    with pytest.raises(anthropic.BadRequestError) as e:
        _anthropic(api_server).messages.create(model="agent", max_tokens=5, messages=messages)
    body = e.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert where in body["error"]["message"] and says in body["error"]["message"], body


def test_messages_api_allows_an_empty_final_assistant_prefill(api_server):
    m = _anthropic(api_server).messages.create(model="agent", max_tokens=2, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}])
    assert m.stop_reason in ("end_turn", "max_tokens")
