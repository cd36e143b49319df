"""`python -m layerstream.bench.paged`: what the paged KV cache and prefix caching buy, in one run, on the benchmark
model streamed at a budget of 25% of its fp32 weights (default).

1. Multi-turn chat over HTTP: 8 turns, each resending the history (previous prompts plus a fixed
   16-token assistant reply) with ~240 new tokens, so the prompt grows to ~2k tokens. Time to first
   token per turn from a server with prefix caching and one started with --no-enable-prefix-caching.
   Each turn is asked --repeats times with different new tokens on the same history (the chat goes
   on from the last one), the two servers alternating request by request; a turn's TTFT is the
   median, so one step slowed by a neighbour on a shared machine does not make the ratio.
2. Concurrency at a fixed budget: how many 256-token sequences run at once in the paged pool the
   planner sizes (measured: the engine's peak of running sequences), against what a slot cache of
   the same bytes holds (computed: one max_model_len reservation per sequence, as before #15).
3. Aggregate generated tok/s over HTTP at 16 concurrent clients vs 1 (same server as 1), the two
   levels alternating for --rounds rounds; each level's rate is its tokens over its time, all rounds.
   Then the same workload in-process (the engine stepped directly, no HTTP, server or client), so
   that what the HTTP stack costs 16 streams shows as the difference between the two ratios.

    python -m layerstream.bench.paged                    # all three; prints Markdown tables
    python -m layerstream.bench.paged --parts chat       # only the chat
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import bench_main, bench_model_path, fmt, free_port, machine_description, table, wait_until_healthy
from .offline import weight_bytes
from .serving import one_request, run_level

TURN_TOKENS = 240
REPLY = [7] * 16  # the assistant's reply resent in the history (fixed: greedy ids are not returned)
# Throughput workload: (concurrency, requests) levels, each request this prompt and 64 greedy tokens.
LEVELS = ((1, 3), (16, 32))
TP_PROMPT = [(i * 7) % 500 + 6 for i in range(16)]
TP_TOKENS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bench", help="model folder ('bench': the ~0.5 GB bf16 benchmark Llama)")
    p.add_argument("--budget-fraction", type=float, default=0.25, help="device budget as a fraction of the fp32 weights")
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-model-len", type=int, default=2304)
    # At 25% of the benchmark model, 512-token chunks leave no room for a 2304-token context: the
    # workspace holds a chunk's attention over the whole context (the planner says so).
    p.add_argument("--max-num-batched-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--parts", default="chat,concurrency,throughput")
    p.add_argument("--repeats", type=_at_least_one, default=3, help="chat: requests per turn (median TTFT)")
    p.add_argument("--rounds", type=_at_least_one, default=2, help="throughput: alternations of the 1 and 16 levels")
    p.add_argument("--timeout", type=float, default=1800)


def _at_least_one(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {raw}")
    return value


def _turn_tokens(turn: int, variant: int = 0) -> list[int]:
    """The turn's new tokens; variants differ in every token, so none shares a block with another."""
    return [(turn * 131 + variant * 3 + i * 17) % 500 + 6 for i in range(TURN_TOKENS)]


def launch(folder: Path, budget: int, log_path: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "layerstream", "serve", "--model", str(folder), "--port", str(port),
            "--max-device-memory", str(budget), *extra]
    print(f"launching: {' '.join(argv)}\n  (log: {log_path})", flush=True)
    proc = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(proc, url, log_path, timeout=600)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


async def chat(urls: dict[str, str], turns: int, repeats: int, timeout: float) -> dict[str, list[tuple[int, float]]]:
    """The same chat against each server, request by request in alternation, so that both see the
    same machine load at each turn (this machine is shared). Each turn: `repeats` variants of its new
    tokens on the same history, variant 0 (the one the chat continues from) last, so its blocks are
    the most recently used when the next turn looks them up; the turn's TTFT is the median."""
    import httpx

    out: dict[str, list[tuple[int, float]]] = {name: [] for name in urls}
    async with httpx.AsyncClient(timeout=timeout) as client:
        models = {name: (await client.get(f"{url}/v1/models")).json()["data"][0]["id"] for name, url in urls.items()}
        for name, url in urls.items():  # first-step costs (page faults, lazy buffers) are no turn's
            warm = {"model": models[name], "prompt": [3] * 64, "max_tokens": 2, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "logprobs": 0}
            await one_request(client, url, warm, timeout)
        history: list[int] = []
        for turn in range(1, turns + 1):
            ttfts: dict[str, list[float]] = {name: [] for name in urls}
            for variant in range(repeats - 1, -1, -1):
                prompt = history + _turn_tokens(turn, variant)
                for name, url in urls.items():
                    # Two tokens: TTFT is the figure; decoding the reply would only lengthen the run.
                    body = {"model": models[name], "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "logprobs": 0}
                    r = await one_request(client, url, body, timeout)
                    if not r.ok:
                        raise RuntimeError(f"{name}, turn {turn}: {r.error}")
                    ttfts[name].append(r.ttft)
            for name, times in ttfts.items():
                out[name].append((len(prompt), statistics.median(times)))
                print(f"    {name}, turn {turn}: prompt {len(prompt)} tokens, TTFT "
                      f"{' '.join(f'{t * 1000:.0f}' for t in times)} ms (median {statistics.median(times) * 1000:.0f})",
                      flush=True)
            history = prompt + REPLY
    return out


async def throughput(url: str, rounds: int, timeout: float) -> dict[int, float]:
    import httpx

    async with httpx.AsyncClient(timeout=30) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
    body = {"model": model, "prompt": TP_PROMPT, "max_tokens": TP_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "logprobs": 0}
    await run_level(url, {}, {**body, "max_tokens": 4}, 1, 1, timeout)  # warm-up
    tokens = {c: 0 for c, _ in LEVELS}
    seconds = {c: 0.0 for c, _ in LEVELS}
    for r in range(rounds):  # alternated, so that load drifting on a shared machine hits both levels
        for c, n in LEVELS:
            res = await run_level(url, {}, body, c, n, timeout)
            if res.ok != n:
                raise RuntimeError(f"concurrency {c}: {res.errors[:1]}")
            tokens[c] += res.tokens
            seconds[c] += res.seconds
            print(f"    round {r + 1}, concurrency {c}: {res.tok_per_s:.1f} tok/s aggregate", flush=True)
    return {c: tokens[c] / seconds[c] for c in tokens}


def engine_rates(engine, rounds: int) -> dict[int, float]:
    """The throughput workload stepped in-process: each level keeps `c` requests in flight until its
    `n` are done, alternating levels for `rounds` rounds; tokens over time per level, all rounds."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=TP_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = {c: 0 for c, _ in LEVELS}
    seconds = {c: 0.0 for c, _ in LEVELS}
    for r in range(rounds):
        for c, n in LEVELS:
            todo, t0 = n, time.perf_counter()
            while todo or engine.has_unfinished():
                while todo and engine.num_running() + engine.num_waiting() < c:
                    engine.add_request(TP_PROMPT, params)
                    todo -= 1
                engine.step()
            elapsed = time.perf_counter() - t0
            seconds[c] += elapsed
            tokens[c] += n * TP_TOKENS
            print(f"    in-process, round {r + 1}, concurrency {c}: {n * TP_TOKENS / elapsed:.1f} tok/s aggregate",
                  flush=True)
    return {c: tokens[c] / seconds[c] for c in tokens}


def in_process(folder: Path, budget: int, max_model_len: int, max_num_seqs: int, max_num_batched_tokens: int,
               parts: set[str], rounds: int) -> tuple[dict | None, dict[int, float]]:
    """One engine on the benchmark's plan: the concurrency part, then the in-process throughput."""
    from engine.llm_engine import LLMEngine
    from engine.args import EngineArgs
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=str(folder), max_device_memory=budget, max_model_len=max_model_len,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  show_progress=False))
    try:
        conc = concurrency(engine, max_model_len) if "concurrency" in parts else None
        rates = {}
        if "throughput" in parts:
            print("  throughput in-process:", flush=True)
            engine.add_request(TP_PROMPT, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished():  # first-step costs are no level's, as over HTTP
                engine.step()
            rates = engine_rates(engine, rounds)
        return conc, rates
    finally:
        engine.close()


def concurrency(engine, max_model_len: int) -> dict:
    """Peak running 256-token sequences in the planned paged pool, in-process (the engine's own count)."""
    from engine.sampling_params import SamplingParams

    plan = engine.plan
    bpt = plan.kv_cache_bytes // (plan.num_kv_blocks * plan.kv_block_size)
    slot_seqs = plan.kv_cache_bytes // (max_model_len * bpt)
    fits = plan.num_kv_blocks * plan.kv_block_size // 256
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for i in range(fits + 4):  # distinct prompts: no prefix sharing inflates the count
        engine.add_request([(i * 37 + j * 11) % 500 + 6 + (j == 0) * i for j in range(240)], params)
    peak, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        peak = max(peak, engine.num_running())
    kv = engine.telemetry().kv
    return dict(pool_bytes=plan.kv_cache_bytes, blocks=plan.num_kv_blocks, slot=slot_seqs, paged=peak,
                preemptions=kv.preemptions, seconds=time.perf_counter() - t0, requests=fits + 4)


def run(ns: argparse.Namespace) -> int:
    parts = {p.strip() for p in ns.parts.split(",") if p.strip()}
    folder = bench_model_path() if ns.model == "bench" else Path(ns.model)
    fp32 = weight_bytes(folder, "float32")[0]
    budget = int(ns.budget_fraction * fp32)
    import torch

    from engine import ops

    attention = "bf16 matmul path" if ops.bf16_matmul_attention() else "SDPA"
    print(f"model {folder}; budget {budget / 1e6:.0f} MB = {ns.budget_fraction:.0%} of the fp32 weights "
          f"({fp32 / 1e9:.2f} GB); machine: {machine_description()}; torch threads {torch.get_num_threads()} "
          f"(servers and in-process alike); CPU attention: {attention} (LAYERSTREAM_CPU_ATTENTION="
          f"{ops.cpu_attention_mode()})", flush=True)
    common = ["--max-model-len", str(ns.max_model_len), "--max-num-seqs", str(ns.max_num_seqs),
              "--max-num-batched-tokens", str(ns.max_num_batched_tokens)]
    ttft: dict[str, list] = {}
    rates: dict[int, float] = {}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, flags in (("prefix caching", []), ("no prefix caching", ["--no-enable-prefix-caching"])):
            if name == "prefix caching" or "chat" in parts:
                log = Path("/tmp") / f"bench-paged-{name.replace(' ', '-')}.log"
                servers[name] = launch(folder, budget, log, common + flags)
        if "chat" in parts:
            print("  chat:", flush=True)
            ttft = asyncio.run(chat({name: url for name, (_, url) in servers.items()}, ns.turns, ns.repeats,
                                    ns.timeout))
        for name, (proc, _) in list(servers.items()):
            if name != "prefix caching":
                stop(proc)
                del servers[name]
        if "throughput" in parts:
            print("  throughput:", flush=True)
            rates = asyncio.run(throughput(servers["prefix caching"][1], ns.rounds, ns.timeout))
    finally:
        for proc, _ in servers.values():
            stop(proc)
    conc, local_rates = None, {}
    if parts & {"concurrency", "throughput"}:
        conc, local_rates = in_process(folder, budget, ns.max_model_len, ns.max_num_seqs, ns.max_num_batched_tokens,
                                       parts, ns.rounds)

    print()
    if ttft:
        on, off = ttft.get("prefix caching"), ttft.get("no prefix caching")
        rows = []
        for i in range(len(on or off)):
            a = on[i][1] if on else None
            b = off[i][1] if off else None
            rows.append([str(i + 1), str((on or off)[i][0]), fmt(a * 1000 if a else None, 0),
                         fmt(b * 1000 if b else None, 0), fmt(b / a if a and b else None, 1) + "x"])
        print(table(["turn", "prompt tokens", f"TTFT cached (ms, median of {ns.repeats})",
                     f"TTFT uncached (ms, median of {ns.repeats})", "uncached / cached"], rows))
        print()
    if conc:
        print(table(["KV pool", f"slot cache (max_model_len {ns.max_model_len} each)", "paged, measured peak", "ratio",
                     "preemptions"],
                    [[f"{conc['pool_bytes'] / 2**20:.1f} MiB ({conc['blocks']} blocks)", str(conc["slot"]),
                      str(conc["paged"]), fmt(conc["paged"] / max(conc["slot"], 1), 1) + "x",
                      str(conc["preemptions"])]]))
        print()
    if rates:
        print(table(["concurrency", "aggregate tok/s over HTTP", "vs 1", "in-process tok/s (no HTTP)", "vs 1"],
                    [[str(c), fmt(r, 1), fmt(r / rates[1], 1) + "x", fmt(local_rates[c], 1),
                      fmt(local_rates[c] / local_rates[1], 1) + "x"] for c, r in rates.items()]))
    return 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m layerstream.bench.paged", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
