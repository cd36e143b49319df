"""A real `layerstream serve` subprocess on loopback for end-to-end tests: started, stopped, and the checks
every server test makes of its answers (OpenAI's error shape, SSE framing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai

from layerstream.bench.common import free_port, wait_until_healthy


ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Server:
    url: str
    model: str
    proc: subprocess.Popen
    log: Path
    api_key: str = "none"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, **kw)

    def async_client(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0, **kw)

    def metric(self, name: str, **labels) -> float:
        return _metric_value(httpx.get(self.url + "/metrics").text, name, labels)

    async def metric_async(self, client: httpx.AsyncClient, name: str, **labels) -> float:
        """The same through an async client (its base_url this server's), so that polling inside an
        event loop does not block the requests in flight on that loop."""
        return _metric_value((await client.get("/metrics")).text, name, labels)


def _metric_value(text: str, name: str, labels: dict) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def start_server(tmp: Path, name: str, argv: list[str], env: dict[str, str]) -> Server:
    port = free_port()
    log = tmp / f"{name}.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSTREAM_") or k == "LAYERSTREAM_CACHE"}
    proc = subprocess.Popen([sys.executable, "-m", "layerstream", "serve", "--port", str(port), *argv],
                            cwd=ROOT, env={**clean, **env}, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, log, timeout=180)
    return Server(url, "", proc, log)


def stop_server(server: Server) -> None:
    server.proc.terminate()
    try:
        server.proc.wait(15)
    except subprocess.TimeoutExpired:
        server.proc.kill()


def sse_events(resp: httpx.Response) -> list:
    """Parse an SSE body strictly: every event is one `data: ...` line followed by a blank line."""
    body = resp.text
    assert body.endswith("data: [DONE]\n\n"), body[-200:]
    frames = body.split("\n\n")[:-1]
    out = []
    for f in frames:
        assert f.startswith("data: ") and "\n" not in f, f
        out.append(f[6:] if f == "data: [DONE]" else json.loads(f[6:]))
    return out


def assert_error(resp: httpx.Response, status: int, param: str | None = "", contains: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and isinstance(err["message"], str) and err["message"]
    if param != "":
        assert err["param"] == param, err
    assert contains in err["message"], err
    return err
