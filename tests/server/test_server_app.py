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
import time
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

ROOT = Path(__file__).resolve().parents[2]


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
    # The reason, without the exception's text (which may hold paths).
    assert r.status_code == 503 and r.json()["status"] == "failed: the model failed to load (ValueError)"
    assert _request(app, "POST", "/v1/completions", json={"prompt": "hi"}).status_code == 503


POISON = 7  # a prompt containing this token id makes every forward pass it is part of fail


def _faulty_factory(state: dict, fail=RuntimeError("simulated device failure")):
    """A real engine over the tiny model whose forward pass fails (with `fail`) whenever a sequence
    whose prompt holds POISON is in it, or every pass once `fail_all` is set."""

    def factory(args):
        engine = LLMEngine(args)
        runner = engine.model.runner
        execute = runner.execute

        def faulty(chunks, *args):
            state["passes"] += 1
            if state.get("fail_all") or any(POISON in c.seq.prompt_ids for c in chunks):
                raise fail
            return execute(chunks, *args)

        runner.execute = faulty
        return engine

    return factory


@pytest.fixture(scope="module")
def flaky_engine(llama_dir):
    """The faulty engine, with the server's metrics as its observer, as in `layerstream serve`."""
    state = {"passes": 0}
    metrics = ServerMetrics("m")
    loop = EngineLoop(EngineArgs(model=str(llama_dir), max_model_len=128, show_progress=False),
                      observer=metrics, engine_factory=_faulty_factory(state)).start()
    assert loop.wait_ready(120), loop.error
    yield loop, state, metrics
    loop.shutdown()


def _run_all(app, requests: list[tuple[str, dict]]) -> list[httpx.Response]:
    """POST the bodies concurrently through one in-process client."""
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     timeout=60) as c:
            return await asyncio.gather(*(c.post(path, json=body) for path, body in requests))

    return asyncio.run(go())


INNOCENT = {"prompt": [11, 12, 13], "max_tokens": 20, "temperature": 0, "ignore_eos": True}


def test_a_failing_sequence_fails_alone(flaky_engine):
    """A forward pass that fails because of one sequence fails that request (500 with an error id,
    no internal text) while the others in the same steps complete exactly as they do alone."""
    engine, state, metrics = flaky_engine
    app = build_app(engine, "m", metrics=metrics)
    alone = _request(app, "POST", "/v1/completions", json=INNOCENT).json()["choices"][0]["text"]
    stream = {**INNOCENT, "prompt": [11, 12, 14], "stream": True}
    stream_alone = _request(app, "POST", "/v1/completions", json=stream).text
    hostile = {"prompt": [5, 6, POISON], "max_tokens": 20, "temperature": 0, "n": 2}
    failed_before = _finished(app, "error")
    r_ok, r_bad, r_stream, r_chat_bad = _run_all(app, [
        ("/v1/completions", INNOCENT), ("/v1/completions", hostile), ("/v1/completions", stream),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3,
                                  "stream": True}),
    ])
    assert r_ok.status_code == 200 and r_ok.json()["choices"][0]["text"] == alone
    assert r_ok.json()["usage"]["completion_tokens"] == 20
    assert r_stream.status_code == 200
    assert [ln for ln in r_stream.text.splitlines() if '"text"' in ln].__len__() == \
        [ln for ln in stream_alone.splitlines() if '"text"' in ln].__len__()
    assert r_chat_bad.status_code == 200  # chat without POISON: innocent too
    err = r_bad.json()["error"]
    assert r_bad.status_code == 500 and err["code"] == 500 and "error id err-" in err["message"]
    assert "simulated" not in err["message"] and "RuntimeError" not in err["message"]
    assert _finished(app, "error") == failed_before + 2  # both choices of the hostile request
    assert engine.ready and not engine.engine.has_unfinished()
    # Alone in its steps, the hostile request still cannot make the engine give up: the probe
    # after a step that nobody survived runs fine.
    for _ in range(3):
        assert _request(app, "POST", "/v1/completions", json=hostile).status_code == 500
    assert engine.ready
    # Streamed, the same failure is an error frame then [DONE]; the engine keeps serving.
    frames = _request(app, "POST", "/v1/completions", json={**hostile, "stream": True}).text.split("\n\n")[:-1]
    assert frames[-1] == "data: [DONE]" and json.loads(frames[-2][6:])["error"]["code"] == 500
    assert _request(app, "POST", "/v1/completions", json=INNOCENT).json()["choices"][0]["text"] == alone


def _finished(app, reason: str) -> float:
    return _metric(app, "layerstream_request_finished_total", finished_reason=reason)


def _metric(app, name: str, **labels) -> float:
    text = _request(app, "GET", "/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_steps_failing_for_everyone_make_the_engine_not_ready(llama_dir):
    """When every pass fails whoever runs in it, a one-token probe fails too: the fault is the
    engine's, not a request's, and it goes not-ready: /health 503 with a reason, metrics say why,
    requests in flight and new ones get 503, and the failure's internal text reaches no client."""
    state = {"passes": 0}
    metrics = ServerMetrics("m")
    engine = EngineLoop(EngineArgs(model=str(llama_dir), max_model_len=128, show_progress=False),
                        observer=metrics, engine_factory=_faulty_factory(state)).start()
    try:
        assert engine.wait_ready(120), engine.error
        app = build_app(engine, "m", metrics=metrics)
        assert _metric(app, "layerstream_engine_ready") == 1
        state["fail_all"] = True
        r = _request(app, "POST", "/v1/completions", json={**INNOCENT, "max_tokens": 50})
        assert r.status_code == 503 and "simulated" not in r.text
        assert engine.state == "unhealthy" and engine.reason == "the engine cannot run a step (RuntimeError)"
        h = _request(app, "GET", "/health")
        assert h.status_code == 503 and h.json()["status"].startswith("unhealthy:")
        assert "simulated" not in h.text
        assert _metric(app, "layerstream_engine_ready") == 0
        assert _metric(app, "layerstream_engine_not_ready", reason=engine.reason) == 1
        r = _request(app, "POST", "/v1/completions", json=INNOCENT)
        assert r.status_code == 503 and "simulated" not in r.text
    finally:
        engine.shutdown()


def test_a_fatal_device_error_makes_the_engine_not_ready_at_once(llama_dir):
    """A CUDA device-side assert poisons the device: no retry, the engine goes not-ready at the
    first one and every request in flight ends with a 503 (streams: an error frame, then [DONE])."""
    state = {"passes": 0}
    metrics = ServerMetrics("m")
    fatal = RuntimeError("CUDA error: device-side assert triggered")
    engine = EngineLoop(EngineArgs(model=str(llama_dir), max_model_len=128, show_progress=False),
                        observer=metrics, engine_factory=_faulty_factory(state, fatal)).start()
    try:
        assert engine.wait_ready(120), engine.error
        app = build_app(engine, "m", metrics=metrics)
        innocent, hostile = _run_all(app, [("/v1/completions", {**INNOCENT, "stream": True}),
                                           ("/v1/completions", {**INNOCENT, "prompt": [POISON]})])
        assert engine.state == "unhealthy" and engine.reason == "fatal device error: RuntimeError"
        assert hostile.status_code == 503
        frames = innocent.text.split("\n\n")[:-1]
        assert frames[-1] == "data: [DONE]" and json.loads(frames[-2][6:])["error"]["code"] == 503
        passes = state["passes"]
        assert _request(app, "GET", "/health").status_code == 503
        assert _metric(app, "layerstream_engine_not_ready", reason=engine.reason) == 1
        assert _request(app, "POST", "/v1/completions", json=INNOCENT).status_code == 503
        assert state["passes"] == passes  # nothing runs on a poisoned device
    finally:
        engine.shutdown()


def test_a_client_that_stops_reading_is_cancelled_not_buffered(flaky_engine):
    """Outputs nobody reads are bounded: past max_unread the handle's requests are cancelled in
    the engine (their slots free) and the reader, if it ever resumes, gets ClientTooSlowError after
    what was queued."""
    from engine.engine_loop import ClientTooSlowError, EngineRequest
    from engine.sampling_params import SamplingParams

    engine, _, metrics = flaky_engine
    app = build_app(engine, "m", metrics=metrics)
    aborted = _finished(app, "abort")
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)

    async def go():
        handle = engine.submit([EngineRequest("slow-reader", [11, 12, 13], params)])
        handle.max_unread = 5
        await handle.accepted
        while not handle._overflowed:  # the client reads nothing meanwhile
            await asyncio.sleep(0.01)
        got = []
        with pytest.raises(ClientTooSlowError):
            async for out in handle.outputs():
                got.append(out)
        return got

    got = asyncio.run(go())
    assert len(got) == 5 and not any(o.finished for o in got)
    deadline = time.monotonic() + 30
    while _finished(app, "abort") < aborted + 1:
        assert time.monotonic() < deadline, "the engine never cancelled the unread request"
        time.sleep(0.05)
    assert not engine.engine.has_unfinished()


def test_fatal_device_errors_are_told_from_others():
    from engine.failures import is_fatal_device_error

    assert is_fatal_device_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as inner:
            raise RuntimeError("streaming block 3 failed") from inner
    except RuntimeError as outer:
        assert is_fatal_device_error(outer)
    assert not is_fatal_device_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_fatal_device_error(ValueError("bad shape"))
    accelerator_error = getattr(__import__("torch"), "AcceleratorError", None)
    if accelerator_error is not None:
        assert is_fatal_device_error(accelerator_error("device-side assert"))


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
    state["passes"] = 0
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

    async def go():
        handle = engine.submit([EngineRequest(f"share-{i}", [11 + i, 12, 13], params) for i in range(4)])
        return [o async for o in handle.outputs()]

    outs = asyncio.run(go())
    assert sorted(o.request_id for o in outs if o.finished) == [f"share-{i}" for i in range(4)]
    assert len(outs) == 40 and state["passes"] <= 11


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
    # The finished request's blocks are free again (its full ones at most cached for later prompts).
    assert t.kv.blocks_total >= 1 and t.kv.blocks_used == 0 and t.kv.usage == 0.0
    assert t.kv.queried_tokens >= 1
    text = _request(app, "GET", "/metrics").text
    steps = sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "layerstream_steps_total")
    assert steps == t.steps
