"""Serving LoRA adapters over HTTP, in-process (httpx's ASGI transport over the real engine loop and a tiny
Llama): /v1/models lists them under the base, the model field picks one (OpenAI and Anthropic routes), an
unknown model is a 404 in OpenAI's shape, vLLM's load and unload endpoints with their errors, and the prefix
cache kept apart per adapter."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from engine import EngineArgs
from engine.engine_loop import EngineLoop
from server.app import build_app
from tests.support.lora import make_adapter

BASE = "base-model"
PROMPT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "


def _request(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


@pytest.fixture(scope="module")
def folders(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    return {"a": make_adapter(root / "a", llama_dir, seed=1, std=0.3),
            "b": make_adapter(root / "b", llama_dir, r=8, targets=("q_proj", "v_proj"), seed=2, std=0.3),
            "c": make_adapter(root / "c", llama_dir, r=2, targets=("down_proj",), seed=3, std=0.3)}


@pytest.fixture(scope="module")
def served(llama_dir, folders):
    args = EngineArgs(model=str(llama_dir), dtype="float32", max_model_len=128, show_progress=False,
                      lora_modules=[f"a={folders['a']}", f"b={folders['b']}"])
    loop = EngineLoop(args).start()
    assert loop.wait_ready(120), loop.error
    yield build_app(loop, BASE), loop
    loop.shutdown()


def _complete(app, model: str, prompt: str = PROMPT) -> httpx.Response:
    return _request(app, "POST", "/v1/completions",
                    json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})


def test_models_lists_the_base_then_each_adapter_with_the_base_as_parent(served, folders):
    app, _ = served
    data = _request(app, "GET", "/v1/models").json()["data"]
    assert [(m["id"], m["parent"]) for m in data] == [(BASE, None), ("a", BASE), ("b", BASE)]
    assert data[1]["root"] == str(folders["a"])
    card = _request(app, "GET", "/v1/models/b").json()
    assert card["id"] == "b" and card["parent"] == BASE


def test_the_model_field_selects_the_base_or_an_adapter(served):
    app, _ = served
    texts = {}
    for model in (BASE, "a", "b"):
        r = _complete(app, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        texts[model] = r.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3  # three different models answered
    assert _complete(app, "a").json()["choices"][0]["text"] == texts["a"]  # and the same one again
    chat = _request(app, "POST", "/v1/chat/completions",
                    json={"model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert chat.status_code == 200 and chat.json()["model"] == "b"
    msg = _request(app, "POST", "/v1/messages",
                   json={"model": "a", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert msg.status_code == 200 and msg.json()["model"] == "a"


def test_an_unknown_model_is_a_404_in_openai_shape(served):
    app, _ = served
    r = _complete(app, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "NotFoundError" and err["param"] == "model" and err["code"] == 404
    assert "`nope` does not exist" in err["message"] and "`a`" in err["message"]
    r = _request(app, "POST", "/v1/chat/completions",
                 json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    r = _request(app, "POST", "/v1/messages",
                 json={"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert _request(app, "GET", "/v1/models/nope").status_code == 404


def test_load_and_unload_at_run_time_and_their_errors(served, folders, tmp_path):
    app, _ = served
    load = lambda name, path: _request(app, "POST", "/v1/load_lora_adapter",  # noqa: E731
                                       json={"lora_name": name, "lora_path": str(path)})
    unload = lambda name: _request(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": name})  # noqa: E731
    assert _complete(app, "c").status_code == 404
    r = load("c", folders["c"])
    assert r.status_code == 200 and "added successfully" in r.text
    assert [m["id"] for m in _request(app, "GET", "/v1/models").json()["data"]] == [BASE, "a", "b", "c"]
    assert _complete(app, "c").status_code == 200

    r = load("c", folders["a"])
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = load(BASE, folders["a"])
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    r = load("d", tmp_path / "missing")
    assert r.status_code == 400 and "does not exist" in r.json()["error"]["message"]
    bad = tmp_path / "corrupt"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((folders["a"] / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    r = load("d", bad)
    assert r.status_code == 400 and "not a valid safetensors file" in r.json()["error"]["message"]
    r = _request(app, "POST", "/v1/load_lora_adapter", json={"lora_name": "d"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"

    r = unload("c")
    assert r.status_code == 200 and "removed successfully" in r.text
    assert _complete(app, "c").status_code == 404
    r = unload("c")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert "no LoRA adapter named 'c'" in r.json()["error"]["message"]


def test_the_prefix_cache_is_not_shared_between_adapters(served):
    app, loop = served

    prompt = "a prompt no other test sends, long enough to fill a few blocks of the prefix cache " * 2

    def hits_of(model: str) -> int:
        before = loop.telemetry().kv.hit_tokens
        assert _complete(app, model, prompt).status_code == 200
        return loop.telemetry().kv.hit_tokens - before

    hits_of(BASE)
    assert hits_of("a") == 0  # the base's blocks hold the base's K/V, not a's
    assert hits_of("b") == 0
    assert hits_of("a") > 0  # a's own blocks are found again
    assert hits_of(BASE) > 0


def test_lora_modules_flag_env_and_ray_arguments(monkeypatch):
    import argparse

    from server.launch import add_arguments, parse_flags

    def parse(argv):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return p.parse_args(argv)

    assert parse(["demo", "--lora-modules", "a=/x", "b=/y"]).lora_modules == ["a=/x", "b=/y"]
    assert parse_flags({"model": "demo", "lora_modules": ["a=/x", "b=/y"]}).lora_modules == ["a=/x", "b=/y"]
    monkeypatch.setenv("LAYERSTREAM_LORA_MODULES", "a=/x b=/y")
    assert EngineArgs(model="demo", lora_modules=parse(["demo"]).lora_modules).lora_modules == {"a": "/x", "b": "/y"}
