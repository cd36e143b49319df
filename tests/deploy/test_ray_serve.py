"""Two CPU replicas of the server on a local Ray cluster (`ray.init(num_cpus=2)`), driven through
Serve's HTTP proxy by the official openai client: concurrent requests, streamed and not, spread
over both replicas (the x-layerstream-replica header); a client that goes away frees its engine
slot; one replica actor killed mid-load fails only its own in-flight requests, with an error the
client sees, and Serve replaces it.

Marked `ray`; skipped where Ray is not installed (`pip install '.[ray]'`). One cluster for the
module: about a minute on an idle 2-core machine, most of it Ray starting and replicas loading.
"""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from layerstream.bench.common import free_port  # noqa: E402
from server.ray_serve import APP_NAME, REPLICA_HEADER, build_application, parse_flags  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
HEADER = REPLICA_HEADER.decode()
LONG = 900  # tokens of a request that must still be running when a replica is killed
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def slow_model_dir(tmp_path_factory):
    """A random Llama wide enough that a 900-token request takes seconds on one thread, with a
    context long enough to hold it."""
    from transformers import LlamaConfig

    from engine.demo import build_random_model

    # (hidden 256 x 4 layers answered a whole 900-token request within 1 s in some runs here)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    return build_random_model(tmp_path_factory.mktemp("ray-model"), config, seed=17)


@pytest.fixture(scope="module")
def cluster(slow_model_dir):
    # A cluster of its own ("local"), whatever else runs on the machine; replicas import this
    # checkout's engine and server, whatever the venv's install points at.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        ns = parse_flags({"model": str(slow_model_dir), "num_replicas": "2", "max_model_len": "1024",
                          "served_model_name": "m", "max_ongoing_requests": "3"})
        serve.run(build_application(ns), name=APP_NAME, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def client(url: str, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120, **kw)


def complete(url: str, max_tokens: int, stream: bool, on_first_chunk=None):
    """(replica, text, finish_reason, completion tokens) of one greedy completion; a stream calls
    on_first_chunk(replica) when its first chunk arrives."""
    c = client(url)
    args = dict(model="m", prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        raw = c.completions.with_raw_response.create(**args)
        r = raw.parse()
        return raw.headers[HEADER], r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    with c.completions.with_streaming_response.create(**args, stream=True,
                                                     stream_options={"include_usage": True}) as raw:
        text, reason, tokens = "", None, None
        for chunk in raw.parse():
            if on_first_chunk is not None:
                on_first_chunk(raw.headers[HEADER])
                on_first_chunk = None
            for choice in chunk.choices:
                text += choice.text
                reason = choice.finish_reason or reason
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        return raw.headers[HEADER], text, reason, tokens


def replica_states() -> dict:
    return serve.status().applications[APP_NAME].deployments["layerstream"].replica_states


def test_replicas_are_ready_once_deployed(cluster):
    # serve.run returns once every replica's constructor has: each has loaded its model by then.
    with httpx.Client(base_url=cluster, timeout=30) as c, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: c.get("/health"), range(8)))
    assert [(r.status_code, r.json()) for r in answers] == [(200, {"status": "ok"})] * 8


def test_concurrent_requests_spread_over_both_replicas(cluster):
    jobs = [(16, i % 2 == 0) for i in range(12)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(cluster, *job), jobs))
    assert len({replica for replica, *_ in results}) == 2, results
    # Same weights and greedy decoding on every replica: one text, streamed or not.
    assert len({text for _, text, _, _ in results}) == 1, results
    assert all(reason == "length" and tokens == 16 for _, _, reason, tokens in results), results


ABORTED = re.compile(r'^layerstream_request_finished_total\{finished_reason="abort",model_name="m"\} (\S+)$', re.M)


def aborted(url: str) -> float:
    """Engine requests cancelled, summed over the replicas: /metrics goes to whichever replica the
    router picks, so ask a few at once until both have answered."""
    by_replica = {}
    with httpx.Client(base_url=url, timeout=30) as c, ThreadPoolExecutor(4) as pool:
        for _ in range(20):
            for r in pool.map(lambda _: c.get("/metrics"), range(4)):
                m = ABORTED.search(r.text)
                by_replica[r.headers[HEADER]] = float(m.group(1)) if m else 0.0
            if len(by_replica) == 2:
                return sum(by_replica.values())
    raise AssertionError(f"/metrics reached only {sorted(by_replica)}")


def test_client_disconnect_cancels_the_engine_request(cluster):
    body = {"model": "m", "prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    before = aborted(cluster)
    with httpx.Client(base_url=cluster, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            next(r.iter_lines())  # the stream runs; now go away
    with pytest.raises(httpx.ReadTimeout):  # a whole response the client stops waiting for
        r = httpx.post(cluster + "/v1/completions", json=body, timeout=1.0)
        pytest.fail(f"a {LONG}-token request answered within 1 s: {r.status_code} {r.text[:300]}")
    # Both would run for seconds more if nothing cancelled them, and then finish as "length".
    deadline = time.monotonic() + 30
    while aborted(cluster) < before + 2:
        assert time.monotonic() < deadline, "the engine requests of clients that went away were not aborted"
        time.sleep(0.2)


def _outcome(future):
    try:
        return future.result()
    except Exception as e:  # noqa: BLE001 - the test sorts errors from results
        return e


def test_killing_a_replica_fails_only_its_requests_and_serve_replaces_it(cluster):
    # Six long requests fill both replicas exactly (max_ongoing_requests 3 each): the killed one
    # holds three of them in flight, whichever they are.
    opened: list[str] = []
    all_open = threading.Event()

    def first_chunk(replica):
        opened.append(replica)
        if len(opened) == 4:
            all_open.set()

    pool = ThreadPoolExecutor(16)
    load = [pool.submit(complete, cluster, LONG, True, first_chunk) for _ in range(4)]
    load += [pool.submit(complete, cluster, LONG, False) for _ in range(2)]
    assert all_open.wait(120), f"only {len(opened)} of 4 streams started"
    victim = opened[0]
    ray.kill(ray.get_actor(f"SERVE_REPLICA::{APP_NAME}#layerstream#{victim}", namespace="serve"), no_restart=True)
    # Sent while Serve notices the death and starts a new replica: none may be lost.
    during = [pool.submit(complete, cluster, 8, i % 2 == 0) for i in range(8)]
    outcomes = [_outcome(f) for f in load]
    failed = [o for o in outcomes if isinstance(o, Exception)]
    served = [o for o in outcomes if not isinstance(o, Exception)]
    print(outcomes)
    assert len(failed) == 3 and len(served) == 3, outcomes
    # Nothing finished on the dead replica, every other request finished whole.
    assert all(replica != victim and reason == "length" and tokens == LONG for replica, _, reason, tokens in served)
    # What the client sees: a stream cut off mid-body (no [DONE]), or a 5xx for a whole response.
    assert all(isinstance(e, (openai.APIConnectionError, openai.InternalServerError)) for e in failed), failed
    assert all(reason == "length" and tokens == 8 for _, _, reason, tokens in (f.result() for f in during))

    deadline = time.monotonic() + 120
    while replica_states().get("RUNNING", 0) < 2:
        assert time.monotonic() < deadline, f"the killed replica was not replaced: {replica_states()}"
        time.sleep(0.5)
    # Serve's routers learn of the new replica by a long poll: it gets traffic within seconds of
    # RUNNING, not at once.
    seen = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        seen |= {r for r, *_ in pool.map(lambda stream: complete(cluster, 4, stream), [True, False] * 3)}
        if len(seen - {victim} - set(opened)) and len(seen) == 2:
            break
        time.sleep(0.5)
    pool.shutdown()
    assert victim not in seen and len(seen) == 2, (victim, seen)
