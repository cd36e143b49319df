"""`python -m layerstream.bench.replicas`: aggregate tokens/s of Ray Serve layouts side by side, on one local
Ray cluster: e.g. one replica with one CPU, one replica with two, two replicas with one each.

Each layout is deployed in turn through `server.ray_serve` (Ray gives a replica one torch thread per
reserved CPU), warmed up, then C clients send streamed /v1/completions back to back through Serve's
proxy (bench-serve's client: fixed prompt, `ignore_eos`, every token its own event). Rounds repeat
the layouts in the same order, so load from elsewhere on the machine falls on all of them alike.

    python -m layerstream.bench.replicas --layouts 1x1,1x2,2x1 --concurrency 8 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from .common import bench_main, bench_model_path, fmt, free_port, machine_description, table
from .offline import prompt_ids
from .serving import run_level


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", default="1x1,1x2,2x1",
                   help="comma-separated REPLICASxCPUS: replicas, and CPUs (torch threads) each")
    p.add_argument("--cluster-cpus", type=int, default=2, help="CPUs of the local Ray cluster")
    p.add_argument("--model", default="bench", help="model folder ('bench': the ~0.5 GB bf16 benchmark Llama)")
    p.add_argument("--concurrency", type=int, default=8, help="clients sending requests back to back")
    p.add_argument("--requests", type=int, default=None, help="requests per measurement (default 2 x concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=2, help="times every layout is measured")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per request")


def parse_layouts(text: str, cluster_cpus: int) -> list[tuple[int, int]]:
    layouts = []
    for item in text.split(","):
        replicas, sep, cpus = item.strip().partition("x")
        if not sep or not replicas.isdigit() or not cpus.isdigit() or int(replicas) < 1 or int(cpus) < 1:
            raise ValueError(f"--layouts: {item!r} is not REPLICASxCPUS, e.g. 2x1")
        if int(replicas) * int(cpus) > cluster_cpus:
            raise ValueError(f"--layouts: {item} needs {int(replicas) * int(cpus)} CPUs, the cluster has {cluster_cpus}")
        layouts.append((int(replicas), int(cpus)))
    return layouts


def run(ns: argparse.Namespace) -> int:
    layouts = parse_layouts(ns.layouts, ns.cluster_cpus)
    import ray
    from ray import serve

    from server.launch import parse_flags
    from server.ray_serve import APP_NAME, build_application

    folder = bench_model_path() if ns.model == "bench" else ns.model
    max_len = -(-(ns.prompt_tokens + ns.max_tokens) // 16) * 16
    requests = ns.requests or 2 * ns.concurrency
    body = {"model": "m", "prompt": prompt_ids(ns.prompt_tokens), "max_tokens": ns.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "logprobs": 0}
    print(f"machine: {machine_description()}; Ray cluster of {ns.cluster_cpus} CPUs; model {folder}")
    print(f"{ns.concurrency} clients, {requests} streamed requests per measurement, prompt {ns.prompt_tokens} "
          f"tokens, {ns.max_tokens} generated tokens each", flush=True)
    # Replicas import this checkout's engine and server, as this process does.
    root = str(Path(__file__).resolve().parents[1])
    ray.init(address="local", num_cpus=ns.cluster_cpus, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": root}})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    tok_s: dict[tuple[int, int], list[float]] = {layout: [] for layout in layouts}
    failed = 0
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for round_ in range(1, ns.rounds + 1):
            for replicas, cpus in layouts:
                flags = parse_flags({"model": str(folder), "served_model_name": "m", "max_model_len": max_len,
                                     "num_replicas": replicas, "replica_cpus": cpus,
                                     "max_num_seqs": ns.concurrency})
                t0 = time.perf_counter()
                serve.run(build_application(flags), name=APP_NAME, route_prefix="/")
                ready = time.perf_counter() - t0
                asyncio.run(run_level(url, {}, {**body, "max_tokens": 4}, replicas, 2 * replicas, ns.timeout))
                res = asyncio.run(run_level(url, {}, body, ns.concurrency, requests, ns.timeout))
                failed += res.requests - res.ok
                tok_s[(replicas, cpus)].append(res.tok_per_s)
                print(f"  round {round_}: {replicas} replica(s) x {cpus} CPU: {res.tok_per_s:6.1f} tok/s, "
                      f"{res.ok}/{res.requests} ok (deployed in {ready:.0f} s)"
                      + (f", first error: {res.errors[0]}" if res.errors else ""), flush=True)
                serve.delete(APP_NAME)  # free the CPUs before the next layout is placed
    finally:
        serve.shutdown()
        ray.shutdown()
    print()
    print(report(tok_s))
    return 0 if failed == 0 else 1


def report(tok_s: dict[tuple[int, int], list[float]]) -> str:
    base = statistics.median(next(iter(tok_s.values())))
    rows = []
    for (replicas, cpus), values in tok_s.items():
        mid = statistics.median(values)
        rows.append([str(replicas), str(cpus), " / ".join(fmt(v, 1) for v in values), fmt(mid, 1),
                     f"{mid / base:.2f}x" if base else "-"])
    first = "x".join(map(str, next(iter(tok_s))))
    return table(["replicas", "CPUs each", "aggregate tok/s per round", "median", f"vs {first}"], rows)


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m layerstream.bench.replicas", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
