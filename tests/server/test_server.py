"""End to end: a real `layerstream serve` subprocess on loopback serving a tiny fp32 llama, driven by
the official openai client (sync and async, streamed and not) and by raw httpx for the wire format.

Two servers per session: `server` (no auth, a device budget that streams most of the 5 blocks, so
the streaming path and its telemetry are exercised) and `auth_server` (configured only through
LAYERSTREAM_* variables, with an API key and room for one running + one waiting request, for the
auth and overload cases).
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from tests.support.server import Server, assert_error, sse_events, start_server, stop_server

PROMPT = "Once upon a time there was"


@pytest.fixture(scope="session")
def server(llama_dir, tmp_path_factory):
    from tests.support.reference import budget_for

    # One block resident, four streamed, under the server's own limits (the planner's figures).
    budget = budget_for(llama_dir, resident=1, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512)
    s = start_server(tmp_path_factory.mktemp("serve"), "server",
                     ["--model", str(llama_dir), "--served-model-name", "tiny", "--max-model-len", "256",
                      "--max-device-memory", str(budget)], {})
    s.model = "tiny"
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def auth_server(llama_dir, tmp_path_factory):
    env = {"LAYERSTREAM_MODEL": str(llama_dir), "LAYERSTREAM_API_KEY": "sekrit",
           "LAYERSTREAM_SERVED_MODEL_NAME": "tiny-auth", "LAYERSTREAM_MAX_MODEL_LEN": "256",
           "LAYERSTREAM_MAX_NUM_SEQS": "1", "LAYERSTREAM_MAX_QUEUE": "1"}
    s = start_server(tmp_path_factory.mktemp("serve-auth"), "auth", [], env)
    s.model, s.api_key = "tiny-auth", "sekrit"
    yield s
    stop_server(s)


@pytest.fixture(scope="session")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


def greedy(**kw) -> dict:
    """Greedy sampling that never stops early, so lengths are known."""
    return {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}, **kw}


# -- models, health, metrics --------------------------------------------------------------------

def test_models_and_health(server):
    assert httpx.get(server.url + "/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]
    raw = httpx.get(server.url + "/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"


def test_metrics_streaming_telemetry(server):
    server.client().completions.create(model="tiny", prompt=PROMPT, **greedy())
    text = httpx.get(server.url + "/metrics").text
    for name in ["layerstream_requests_total", "layerstream_prompt_tokens_total", "layerstream_generation_tokens_total",
                 "layerstream_time_to_first_token_seconds_bucket", "layerstream_time_per_output_token_seconds_bucket",
                 "layerstream_num_requests_running", "layerstream_num_requests_waiting",
                 "layerstream_blocks_resident", "layerstream_blocks_streamed",
                 "layerstream_streamed_bytes_last_step", "layerstream_streaming_gbps",
                 "layerstream_stall_seconds_per_step_bucket"]:
        assert name in text, name
    streamed = server.metric("layerstream_blocks_streamed")
    assert streamed >= 1 and server.metric("layerstream_blocks_resident") + streamed == 5
    assert server.metric("layerstream_planned_streamed_bytes_per_step") > 0
    assert server.metric("layerstream_streamed_bytes_total") > 0
    assert server.metric("layerstream_requests_total", route="/v1/completions", status="200") >= 1


# -- completions --------------------------------------------------------------------------------

def test_completion_fields_and_usage(server, tokenizer):
    r = server.client().completions.create(model="tiny", prompt=PROMPT, logprobs=3, **greedy())
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == "tiny" and r.created > 0
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12 == len(c.logprobs.tokens) == len(c.logprobs.token_logprobs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for lp, top in zip(c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        assert lp == pytest.approx(max(top.values()), abs=1e-5)
    # Streamed, the logprobs of all chunks add up to the same list, offsets included.
    chunks = list(server.client().completions.create(model="tiny", prompt=PROMPT, logprobs=3, stream=True,
                                                     **greedy()))
    assert sum((ch.choices[0].logprobs.tokens for ch in chunks), []) == c.logprobs.tokens
    assert sum((ch.choices[0].logprobs.text_offset for ch in chunks), []) == c.logprobs.text_offset


def test_stream_equals_non_stream(server):
    client = server.client()
    whole = client.completions.create(model="tiny", prompt=PROMPT, **greedy(max_tokens=24))
    parts = list(client.completions.create(model="tiny", prompt=PROMPT, stream=True,
                                           stream_options={"include_usage": True},
                                           **greedy(max_tokens=24)))
    text = "".join(p.choices[0].text for p in parts if p.choices)
    assert text == whole.choices[0].text
    assert parts[-1].choices == [] and parts[-1].usage.completion_tokens == 24
    assert [p.choices[0].finish_reason for p in parts[:-1]][-1] == "length"
    assert all(p.choices[0].finish_reason is None for p in parts[:-2])

    msgs = [{"role": "user", "content": "Hello world!"}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, **greedy())
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, stream=True, **greedy()))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == chat.choices[0].finish_reason == "length"


def test_sse_wire_format(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": events[-2]["usage"]["prompt_tokens"], "completion_tokens": 5,
                                   "total_tokens": events[-2]["usage"]["prompt_tokens"] + 5}
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" and e["id"] == events[0]["id"] for e in events[:-1])

    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
            "temperature": 0, "stream": True, "ignore_eos": True}
    events = sse_events(httpx.post(server.url + "/v1/chat/completions", json=body))
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:-1])
    assert all("usage" not in e or e["usage"] is None for e in events[:-1])


def test_prompt_forms(server, tokenizer):
    client = server.client()
    ids = tokenizer.encode(PROMPT)
    by_text = client.completions.create(model="tiny", prompt=PROMPT, **greedy()).choices[0].text
    assert client.completions.create(model="tiny", prompt=ids, **greedy()).choices[0].text == by_text
    r = client.completions.create(model="tiny", prompt=[PROMPT, "Hello world"], n=2, **greedy())
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == by_text  # greedy: every choice is the same
    assert r.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hello world"))
    assert r.usage.completion_tokens == 4 * 12
    r2 = client.completions.create(model="tiny", prompt=[ids, tokenizer.encode("Hello world")], **greedy())
    assert [c.text for c in r2.choices] == [r.choices[0].text, r.choices[2].text]


def test_echo(server):
    client = server.client()
    plain = client.completions.create(model="tiny", prompt=PROMPT, **greedy()).choices[0].text
    echoed = client.completions.create(model="tiny", prompt=PROMPT, echo=True, **greedy()).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPT, echo=True, stream=True, **greedy()))
    assert streamed == echoed


def test_seed_reproducible_and_n(server):
    client = server.client()
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, top_p=0.95,
              extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert client.completions.create(seed=7, **kw).choices[0].text == a
    assert client.completions.create(seed=8, **kw).choices[0].text != a
    many = client.completions.create(seed=7, n=3, **kw)
    assert many.choices[0].text == a  # choice i uses seed + i, as the offline LLM does
    assert many.choices[1].text == client.completions.create(seed=8, **kw).choices[0].text
    assert client.completions.create(seed=7, n=3, **kw).model_dump()["choices"] == many.model_dump()["choices"]


def test_penalties_accepted(server):
    r = server.client().completions.create(model="tiny", prompt=PROMPT, presence_penalty=1.5, frequency_penalty=1.0,
                                           user="someone", **greedy())
    assert r.usage.completion_tokens == 12


def test_stop_strings_excluded(server):
    client = server.client()
    full = client.completions.create(model="tiny", prompt=PROMPT, **greedy(max_tokens=24))
    text = full.choices[0].text
    # A stop string from the middle of the greedy text: the output must end right before it.
    stop = next(text[i:i + 3] for i in range(4, len(text) - 3)
                if text[i:i + 3].strip() and "\ufffd" not in text[i:i + 3])
    cut = text[:text.find(stop)]
    for kw in ({"stop": stop}, {"stop": ["zzzzqqq", stop]}):
        r = client.completions.create(model="tiny", prompt=PROMPT, **greedy(max_tokens=24), **kw)
        assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt=PROMPT, stream=True, **greedy(max_tokens=24), **kw))
        assert streamed == cut


def test_chat_n_streamed(server):
    msgs = [{"role": "user", "content": "Hi"}]
    chunks = list(server.client().chat.completions.create(model="tiny", messages=msgs, n=2, stream=True,
                                                          **greedy(max_tokens=5)))
    texts = {0: "", 1: ""}
    for ch in chunks:
        (choice,) = ch.choices
        texts[choice.index] += choice.delta.content or ""
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert sum(1 for c in chunks if c.choices[0].finish_reason == "length") == 2
    whole = server.client().chat.completions.create(model="tiny", messages=msgs, **greedy(max_tokens=5))
    assert texts[0] == texts[1] == whole.choices[0].message.content


def test_chat_usage_matches_template(server, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    r = server.client().chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=6, temperature=0,
                                                logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens == 6
    assert len(r.choices[0].logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in r.choices[0].logprobs.content)


def test_chat_default_max_tokens_fills_context(server, tokenizer):
    # A long prompt, so "the rest of the context" is a few dozen tokens, not 250.
    content = "The quick brown fox jumps over the lazy dog. "
    while len(tokenizer.encode(content * 2)) < 200:
        content *= 2
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
                         "ignore_eos": True}, timeout=120)
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 256 and body["usage"]["prompt_tokens"] > 100


# -- async client, concurrency, disconnects -------------------------------------------------------

def test_async_client_stream_and_not(server):
    async def go():
        client = server.async_client()
        whole = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                     **greedy())
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                      stream=True, **greedy())
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        return whole.choices[0].message.content, text

    whole, text = asyncio.run(go())
    assert whole == text


def test_16_concurrent_requests_equal_alone(server):
    prompts = [f"{PROMPT} {i} and" for i in range(16)]

    async def one(client, p, stream):
        if stream:
            s = await client.completions.create(model="tiny", prompt=p, stream=True, **greedy())
            return "".join([c.choices[0].text async for c in s])
        return (await client.completions.create(model="tiny", prompt=p, **greedy())).choices[0].text

    async def go():
        client = server.async_client()
        alone = [await one(client, p, False) for p in prompts]
        together = await asyncio.gather(*(one(client, p, i % 2 == 1) for i, p in enumerate(prompts)))
        return alone, together

    alone, together = asyncio.run(go())
    assert together == alone


def test_disconnect_mid_stream_cancels(server):
    aborted = server.metric("layerstream_request_finished_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(4)]
            assert got[0].startswith("data: ")
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while server.metric("layerstream_request_finished_total", finished_reason="abort") <= aborted:
        assert time.monotonic() < deadline, "the engine never cancelled the request"
        time.sleep(0.1)
    while server.metric("layerstream_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the cancelled request still holds a slot"
        time.sleep(0.1)
    r = server.client().completions.create(model="tiny", prompt=PROMPT, **greedy())
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12


def test_disconnect_non_streamed_cancels(server):
    aborted = server.metric("layerstream_request_finished_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 240, "n": 4, "temperature": 0, "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            post = asyncio.ensure_future(c.post("/v1/completions", json=body))
            while server.metric("layerstream_num_requests_running") == 0:
                assert not post.done(), "finished before it could be cancelled"
                await asyncio.sleep(0.02)
            post.cancel()  # the connection is closed with the response still pending
            with pytest.raises(asyncio.CancelledError):
                await post

    asyncio.run(go())
    deadline = time.monotonic() + 20
    while server.metric("layerstream_request_finished_total", finished_reason="abort") < aborted + 4:
        assert time.monotonic() < deadline, "the engine never cancelled the request"
        time.sleep(0.1)
    while server.metric("layerstream_num_requests_running") != 0:
        assert time.monotonic() < deadline, "the cancelled requests still hold slots"
        time.sleep(0.1)


# -- errors -------------------------------------------------------------------------------------

def test_errors_raw(server):
    url = server.url
    post = lambda path, **kw: httpx.post(url + path, **kw)  # noqa: E731
    assert_error(post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400, contains="JSON")
    assert_error(post("/v1/completions", json=[1, 2]), 400)
    assert_error(post("/v1/completions", json={"model": "tiny"}), 400, param="prompt")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": "many"}), 400,
                 param="max_tokens")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "temperature": -1}), 400,
                 param="temperature")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "top_p": 1.5}), 400, param="top_p")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "n": 0}), 400, param="n")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 0}), 400,
                 param="max_tokens")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "logprobs": 21}), 400,
                 param="logprobs")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": ""}), 400, param="prompt")
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": [10 ** 6]}), 400, param="prompt")
    assert_error(post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400, param="messages")
    assert_error(post("/v1/completions", json={"model": "gpt-4", "prompt": "a"}), 404, param="model",
                 contains="gpt-4")
    err = assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 300}), 400)
    assert all(n in err["message"] for n in ("256", "300", "301"))
    long_prompt = list(range(10, 250))
    err = assert_error(post("/v1/completions", json={"model": "tiny", "prompt": long_prompt, "max_tokens": 20}),
                       400)
    assert all(n in err["message"] for n in ("256", "240", "260"))
    # An error in a streamed request, before the stream starts, is a plain status + JSON body.
    assert_error(post("/v1/completions", json={"model": "tiny", "prompt": "a", "stream": True, "top_k": -5}), 400,
                 param="top_k")
    assert_error(httpx.get(url + "/v1/nope"), 404)


def test_errors_openai_client(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", max_tokens=1000)
    assert "256" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}], temperature=-2)
    assert e.value.body["param"] == "temperature"


def test_auth(auth_server, server):
    url = auth_server.url
    body = {"model": "tiny-auth", "prompt": "a", "max_tokens": 2}
    assert_error(httpx.post(url + "/v1/completions", json=body), 401)
    assert_error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.get(url + "/v1/models"), 401, contains="Authorization: Bearer")
    # Anthropic's clients send the key in x-api-key: their 401 says so.
    r = httpx.post(url + "/v1/messages", json={"model": "tiny-auth", "max_tokens": 2,
                                               "messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert "x-api-key" in r.json()["error"]["message"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in auth_server.client().models.list().data] == ["tiny-auth"]
    assert auth_server.client().completions.create(**body).usage.completion_tokens >= 1
    # health and metrics stay open; without --api-key nothing needs a key
    assert httpx.get(url + "/health").status_code == 200 and httpx.get(url + "/metrics").status_code == 200
    assert httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 2},
                      headers={"Authorization": "Bearer anything"}).status_code == 200


def test_overload_503_with_retry_after(auth_server):
    """One slot and a queue of one: a third request while two are in is refused with 503."""
    headers = {"Authorization": "Bearer sekrit"}
    body = {"model": "tiny-auth", "prompt": PROMPT, "max_tokens": 220, "temperature": 0, "stream": True,
            "ignore_eos": True}

    async def go():
        async with httpx.AsyncClient(base_url=auth_server.url, headers=headers, timeout=60) as c:
            async with c.stream("POST", "/v1/completions", json=body) as first:
                assert first.status_code == 200
                it = first.aiter_lines()
                await it.__anext__()  # first chunk: the request holds the only slot
                async with c.stream("POST", "/v1/completions", json=body) as second:
                    assert second.status_code == 200  # accepted: waiting in the queue
                    third = await c.post("/v1/completions", json={**body, "stream": False})
                    return third

    third = asyncio.run(go())
    assert_error(third, 503)
    assert third.headers["retry-after"] == "1"
    # both streams were dropped: the server recovers
    r = auth_server.client().completions.create(model="tiny-auth", prompt="a", max_tokens=2)
    assert r.usage.completion_tokens >= 1


# -- one request never hurts another --------------------------------------------------------------

def _together(server: Server, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            return await asyncio.gather(*(c.post(path, json=body) for path, body in bodies))

    return asyncio.run(go())


def test_degenerate_sampling_values_hurt_nobody(server):
    """Values that used to underflow to NaN probabilities and fail every sequence in the step: in
    range they are served (a temperature under the epsilon is greedy), out of range refused with a
    400 naming the field; concurrent innocent requests get exactly what they get alone."""
    innocent = {"model": "tiny", "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    alone = httpx.post(server.url + "/v1/completions", json=innocent, timeout=60).json()["choices"][0]["text"]
    hostile = [
        ({**innocent, "temperature": 1e-30}, 200),
        ({**innocent, "temperature": 1.0, "top_p": 1e-50}, 200),  # keeps only the best token: greedy
        ({**innocent, "temperature": 1.0, "top_p": 0}, 200),
        ({**innocent, "repetition_penalty": 1e-30}, 400),
        ({**innocent, "temperature": 2.5}, 400),
        ({**innocent, "top_p": 1.5}, 400),
        ({**innocent, "presence_penalty": -2.5}, 400),
        ({**innocent, "frequency_penalty": 3}, 400),
        ({**innocent, "min_p": -0.5}, 400),
    ]
    bodies = [("/v1/completions", innocent), ("/v1/completions", {**innocent, "stream": True})]
    bodies += [("/v1/completions", body) for body, _ in hostile]
    responses = _together(server, bodies)
    assert responses[0].status_code == 200 and responses[0].json()["choices"][0]["text"] == alone
    streamed = "".join(e["choices"][0]["text"] for e in sse_events(responses[1])[:-1])
    assert streamed == alone
    for (body, status), r in zip(hostile, responses[2:]):
        if status == 200:
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone, body
        else:
            field = next(k for k in body if body[k] != innocent.get(k))
            assert_error(r, 400, param=field)
