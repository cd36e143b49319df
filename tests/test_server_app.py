"""The server in-process (httpx's ASGI transport, no sockets): states that are hard to reach from
outside a real server: loading, a failed load, an engine that fails mid-stream; plus the
LAYERSTREAM_* environment defaults and the exit status of a server whose model cannot load."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine import EngineArgs
from server.app import build_app
from server.cli import add_arguments
from server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[1]


def _request(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_health_503_while_loading_then_failed():
    release = threading.Event()

    def slow_factory(_args):
        release.wait(30)
        raise ValueError("budget too small for this model")

    engine = EngineLoop(EngineArgs(model="unused"), engine_factory=slow_factory).start()
    app = build_app(engine, "m")
    r = _request(app, "GET", "/health")
    assert r.status_code == 503 and r.json()["status"] == "loading"
    r = _request(app, "POST", "/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "loading" in r.json()["error"]["message"]
    assert _request(app, "GET", "/v1/models").json()["data"][0]["id"] == "m"
    release.set()
    assert not engine.wait_ready(10)
    r = _request(app, "GET", "/health")
    assert r.status_code == 503 and "budget too small" in r.json()["status"]
    assert _request(app, "POST", "/v1/completions", json={"prompt": "hi"}).status_code == 503


@pytest.fixture(scope="module")
def flaky_engine(llama_dir):
    """A real engine over the tiny model whose step fails once `fail_after` steps have run; its
    observer is the server's metrics, as in `layerstream serve`."""
    state = {"fail_after": None, "steps": 0}
    metrics = ServerMetrics("m")

    def factory(args):
        engine = LLMEngine(args)
        step = engine.step

        def flaky_step():
            state["steps"] += 1
            if state["fail_after"] is not None and state["steps"] > state["fail_after"]:
                raise RuntimeError("simulated device failure")
            return step()

        engine.step = flaky_step
        return engine

    loop = EngineLoop(EngineArgs(model=str(llama_dir), max_model_len=128, show_progress=False),
                      observer=metrics, engine_factory=factory).start()
    assert loop.wait_ready(120), loop.error
    yield loop, state, metrics
    loop.shutdown()


def test_engine_error_mid_stream_is_an_sse_error_frame(flaky_engine):
    engine, state, _ = flaky_engine
    app = build_app(engine, "m")
    body = {"prompt": "Hello", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
    state["steps"], state["fail_after"] = 0, 3
    r = _request(app, "POST", "/v1/completions", json=body)
    assert r.status_code == 200
    frames = r.text.split("\n\n")[:-1]
    assert frames[-1] == "data: [DONE]"
    err = json.loads(frames[-2][len("data: "):])["error"]
    assert err["code"] == 500 and "simulated device failure" in err["message"]
    assert len(frames) >= 3  # some tokens arrived before the failure
    # Chat streams end the same way (one wrapper frames both endpoints' streams).
    state["steps"], state["fail_after"] = 0, 3
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20, "temperature": 0,
            "ignore_eos": True, "stream": True}
    frames = _request(app, "POST", "/v1/chat/completions", json=chat).text.split("\n\n")[:-1]
    assert frames[-1] == "data: [DONE]" and "simulated device failure" in frames[-2]
    assert json.loads(frames[0][len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
    # Non-streamed, the same failure is a 500 in OpenAI's shape; then the engine keeps serving.
    state["steps"], state["fail_after"] = 0, 1
    r = _request(app, "POST", "/v1/completions", json={**body, "stream": False})
    assert r.status_code == 500 and "simulated device failure" in r.json()["error"]["message"]
    state["fail_after"] = None
    r = _request(app, "POST", "/v1/completions", json={**body, "stream": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    assert not engine.engine.has_unfinished()


def _finished(app, reason: str) -> float:
    text = _request(app, "GET", "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "layerstream_request_finished_total" and s.labels["finished_reason"] == reason)


def test_requests_failed_by_a_step_error_are_counted(flaky_engine):
    """Each engine request a failed step fails counts once in layerstream_request_finished, as
    "error"; before, only stop/length/abort were counted, so failures vanished from the metric."""
    engine, state, metrics = flaky_engine
    app = build_app(engine, "m", metrics=metrics)
    before = _finished(app, "error")
    state["steps"], state["fail_after"] = 0, 1
    body = {"prompt": "Hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}
    assert _request(app, "POST", "/v1/completions", json=body).status_code == 500
    state["fail_after"] = None
    assert _finished(app, "error") == before + 2  # n=2: two engine requests failed


def test_sse_events_share_one_framing():
    """Chunks, the [DONE] sentinel and an error event inside a stream are all framed by
    protocol.sse: one line "data: <payload>" and a blank line."""
    from server.errors import APIError, error_for
    from server.protocol import sse
    from server.serving import DONE

    err = error_for(APIError(400, "bad value", param="n"))
    assert err.sse() == sse(err.body) == f"data: {err.body.model_dump_json()}\n\n"
    assert DONE == sse("[DONE]") == "data: [DONE]\n\n"


def test_requests_in_flight_share_steps(flaky_engine):
    """Four 10-token requests submitted together finish in about 10 engine steps, not 40."""
    from engine.engine_loop import EngineRequest
    from engine.sampling_params import SamplingParams

    engine, state, _ = flaky_engine
    state["steps"], state["fail_after"] = 0, None
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def go():
        handle = engine.submit([EngineRequest(f"share-{i}", [11 + i, 12, 13], params) for i in range(4)])
        return [o async for o in handle.outputs()]

    outs = asyncio.run(go())
    assert sorted(o.request_id for o in outs if o.finished) == [f"share-{i}" for i in range(4)]
    assert len(outs) == 40 and state["steps"] <= 11


def test_flags_from_environment(monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_MAX_DEVICE_MEMORY", "4GiB")
    monkeypatch.setenv("LAYERSTREAM_PORT", "9123")
    monkeypatch.setenv("LAYERSTREAM_API_KEY", "k")
    monkeypatch.setenv("LAYERSTREAM_MAX_QUEUE", "7")
    p = argparse.ArgumentParser()
    add_arguments(p)
    ns = p.parse_args([])
    assert (ns.max_device_memory, ns.port, ns.api_key, ns.max_queue, ns.model) == ("4GiB", 9123, "k", 7, "demo")
    assert p.parse_args(["--port", "1"]).port == 1  # the command line wins
    monkeypatch.setenv("LAYERSTREAM_PORT", "not-a-port")
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit):  # checked like the flag itself
        p.parse_args([])


def test_serve_rejects_max_queue_below_one_in_one_line(capsys):
    """Checked by EngineArgs (as for the Python API), before anything loads or listens; the CLI turns
    the ValueError into one line and status 2, no traceback."""
    from layerstream.cli import main

    assert main(["serve", "--max-queue", "0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "layerstream: error: max_queue must be >= 1, got 0\n"


def test_serve_exits_nonzero_when_the_model_cannot_load(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "layerstream", "serve", "--model", str(tmp_path / "missing"),
                           "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "missing" in proc.stderr and "loading the model failed" in proc.stderr


def test_telemetry_is_reachable_from_the_engine_loop(flaky_engine):
    """The snapshot /metrics reads is taken on the engine thread after every step and readable from
    any thread: steps counted once per successful step (as the metrics' step counter), the last
    step's figures, and a KV cache that is empty again once the request finished."""
    engine, state, metrics = flaky_engine
    app = build_app(engine, "m", metrics=metrics)
    state["fail_after"] = None
    before = engine.telemetry().steps
    body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert _request(app, "POST", "/v1/completions", json=body).status_code == 200
    t = engine.telemetry()
    assert t.steps >= before + 6  # the prefill step gives the first token, each decode step one more
    assert t.last_step is not None and t.last_step.seconds > 0
    assert t.kv.slots >= 1 and t.kv.slots_used == 0 and t.kv.tokens_cached == 0
    text = _request(app, "GET", "/metrics").text
    steps = sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "layerstream_steps_total")
    assert steps == t.steps
