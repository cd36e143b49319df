"""`layerstream bench-serve`: throughput of a running server at several concurrencies, side by side.

For each concurrency C, C clients each send streamed /v1/completions requests back to back (fixed
prompt length, fixed completion length: ignore_eos) until the level has sent its requests. Reported
per level: aggregate generated tokens/s (all tokens / wall time of the level), p50/p95 time to
first token, and p50/p95 per-token latency (each request's (last - first token time) / (tokens - 1)).

Each request asks for logprobs=0 so that every generated token arrives in its own SSE event (the
server holds back events whose text delta is empty, e.g. half a UTF-8 character), which makes the
token count and the per-token timing exact.

    layerstream bench-serve --url http://127.0.0.1:8000 --concurrency 1,4,16
    layerstream bench-serve --launch --budget-fraction 0.25 --concurrency 1,4,16 --png serve.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .common import (Chart, bench_main, bench_model_path, fmt, free_port, machine_description, percentile,
                     table, wait_until_healthy)
from .offline import prompt_ids, weight_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server to measure (ignored with --launch)")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated numbers of concurrent clients")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per concurrency level (default: 2 x concurrency, at least 4)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token, if the server wants one")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per request")
    p.add_argument("--png", default=None, help="write a chart of the results to this file")
    p.add_argument("--json", default=None, help="write the raw results to this file")
    g = p.add_argument_group("--launch: start `layerstream serve` for the run, stop it afterwards")
    g.add_argument("--launch", action="store_true")
    g.add_argument("--model", default="bench", help="model to serve ('bench': the ~0.5 GB bf16 benchmark Llama)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-device-memory", default=None, help="budget passed to the server")
    g.add_argument("--budget-fraction", type=float, default=None,
                   help="budget as a fraction of the weights in the compute dtype (e.g. 0.25), instead of "
                        "--max-device-memory")
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--max-num-batched-tokens", type=int, default=64)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: prompt + completion tokens, rounded up to 16")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads in the server (OMP_NUM_THREADS; 0: torch's default)")
    g.add_argument("--server-arg", action="append", default=[], help="extra argument for `layerstream serve`")
    g.add_argument("--server-log", default=None, help="file for the server's log (default: a temporary file)")


# -- one request ------------------------------------------------------------------------------

@dataclass
class RequestResult:
    ok: bool
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)  # arrival of each token, from send
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def per_token(self) -> float | None:
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


async def one_request(client, url: str, body: dict, timeout: float) -> RequestResult:
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, error=f"HTTP {resp.status_code}: {text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return RequestResult(False, error=str(event["error"])[:200])
                now = time.perf_counter() - t0
                for choice in event.get("choices", []):
                    lp = choice.get("logprobs") or {}
                    times += [now] * len(lp.get("tokens") or [])
    except Exception as e:  # noqa: BLE001 - any transport failure is a failed request, counted
        return RequestResult(False, error=f"{type(e).__name__}: {e}")
    if not times:
        return RequestResult(False, error="no tokens")
    return RequestResult(True, times[0], times)


# -- one concurrency level ----------------------------------------------------------------------

@dataclass
class LevelResult:
    concurrency: int
    requests: int
    ok: int
    seconds: float
    tokens: int
    ttft: list[float]
    per_token: list[float]
    errors: list[str]

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


async def run_level(url: str, headers: dict, body: dict, concurrency: int, requests: int,
                    timeout: float) -> LevelResult:
    import httpx

    todo = list(range(requests))
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        async def worker() -> None:
            while todo:
                todo.pop()
                results.append(await one_request(client, url, body, timeout))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - t0
    good = [r for r in results if r.ok]
    return LevelResult(concurrency, requests, len(good), seconds, sum(r.tokens for r in good),
                       [r.ttft for r in good], [r.per_token for r in good if r.per_token is not None],
                       [r.error for r in results if not r.ok])


# -- launching a server -----------------------------------------------------------------------


def launch_server(ns) -> tuple[subprocess.Popen, str, Path]:
    folder = bench_model_path() if ns.model == "bench" else Path(ns.model)
    budget = ns.max_device_memory
    if ns.budget_fraction is not None:
        weights, _ = weight_bytes(folder, ns.dtype)
        budget = str(int(ns.budget_fraction * weights))
    max_len = ns.max_model_len or -(-(ns.prompt_tokens + ns.max_tokens) // 16) * 16
    port = free_port()
    argv = [sys.executable, "-m", "layerstream", "serve", "--model", str(folder), "--port", str(port),
            "--dtype", ns.dtype, "--max-num-seqs", str(ns.max_num_seqs), "--max-num-batched-tokens",
            str(ns.max_num_batched_tokens), "--max-model-len", str(max_len), *ns.server_arg]
    if budget:
        argv += ["--max-device-memory", str(budget)]
    log_path = Path(ns.server_log) if ns.server_log else Path(os.environ.get("TMPDIR", "/tmp")) / f"layerstream-bench-serve-{port}.log"
    log = open(log_path, "w")
    print(f"launching: {' '.join(argv)}\n  (log: {log_path})", flush=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(ns.threads)} if ns.threads else {})}
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, log_path, timeout=600)
    return proc, url, log_path


def plan_lines(log_path: Path) -> list[str]:
    """The memory plan the server logged at load (the planner's resident/streamed/KV trade-off)."""
    lines = log_path.read_text(errors="replace").splitlines()
    for i, line in enumerate(lines):
        if "memory plan" in line:
            plan = [line[line.index("memory plan"):]]
            plan += [l for l in lines[i + 1:i + 12] if l.startswith("  ")]
            return plan
    return []


# -- the command ------------------------------------------------------------------------------

def run(ns: argparse.Namespace) -> int:
    levels = [int(c) for c in ns.concurrency.split(",") if c.strip()]
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency must list positive integers, got {ns.concurrency!r}")
    if ns.max_tokens < 2 or ns.prompt_tokens < 1:
        raise ValueError("--max-tokens >= 2 and --prompt-tokens >= 1 are required")
    proc = None
    url = ns.url.rstrip("/")
    try:
        plan = []
        if ns.launch:
            proc, url, log_path = launch_server(ns)
            plan = plan_lines(log_path)
        results = asyncio.run(_bench(ns, url, levels))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print()
    if plan:
        print("server " + "\n".join(plan) + "\n")
    print(report(results))
    if ns.json:
        Path(ns.json).write_text(json.dumps([r.__dict__ for r in results], indent=2))
    if ns.png:
        chart(results).save(ns.png)
        print(f"\nchart written to {ns.png}")
    return 0 if all(r.ok == r.requests for r in results) else 1


async def _bench(ns, url: str, levels: list[int]) -> list[LevelResult]:
    import httpx

    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:
        try:
            r = await client.get(f"{url}/v1/models")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"cannot list models at {url}/v1/models ({e}); is the server running? "
                             "(--launch starts one)") from e
        model = r.json()["data"][0]["id"]
    prompt = prompt_ids(ns.prompt_tokens)
    body = {"model": model, "prompt": prompt, "max_tokens": ns.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    print(f"server: {url} (model {model}); machine: {machine_description()}")
    print(f"prompt {ns.prompt_tokens} tokens, {ns.max_tokens} generated tokens per request, streamed", flush=True)
    await run_level(url, headers, {**body, "max_tokens": 4}, 1, 1, ns.timeout)  # warm-up
    results = []
    for c in levels:
        n = ns.requests or max(4, 2 * c)
        res = await run_level(url, headers, body, c, n, ns.timeout)
        results.append(res)
        print(f"  concurrency {c:>3}: {res.tok_per_s:7.1f} tok/s aggregate, {res.ok}/{n} ok, "
              f"TTFT p50 {_ms(percentile(res.ttft, 50))} ms, per-token p50 {_ms(percentile(res.per_token, 50))} ms"
              + (f", first error: {res.errors[0]}" if res.errors else ""), flush=True)
    return results


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def report(results: list[LevelResult]) -> str:
    base = results[0].tok_per_s if results else 0
    rows = []
    for r in results:
        rows.append([str(r.concurrency), f"{r.ok}/{r.requests}", fmt(r.tok_per_s, 1),
                     f"{r.tok_per_s / base:.2f}x" if base else "-",
                     _ms(percentile(r.ttft, 50)), _ms(percentile(r.ttft, 95)),
                     _ms(percentile(r.per_token, 50)), _ms(percentile(r.per_token, 95))])
    return table(["concurrency", "ok", "aggregate tok/s", f"vs {results[0].concurrency}" if results else "vs",
                  "TTFT p50 ms", "TTFT p95 ms", "per-token p50 ms", "per-token p95 ms"], rows)


def chart(results: list[LevelResult]) -> Chart:
    c = Chart("continuous batching: concurrent streamed requests")
    labels = [f"{r.concurrency} conc." for r in results]
    c.add("aggregate generated tokens/s", labels, [r.tok_per_s for r in results])
    c.add("TTFT p50 (ms)", labels, [(percentile(r.ttft, 50) or 0) * 1e3 for r in results])
    c.add("TTFT p95 (ms)", labels, [(percentile(r.ttft, 95) or 0) * 1e3 for r in results])
    c.add("per-token latency p50 (ms)", labels, [(percentile(r.per_token, 50) or 0) * 1e3 for r in results])
    c.add("per-token latency p95 (ms)", labels, [(percentile(r.per_token, 95) or 0) * 1e3 for r in results])
    return c


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m layerstream.bench.serving", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
