"""`layerstream bench`: decode speed and memory of transformers vs layerstream (all resident) vs
layerstream streaming under a budget of a fraction of the weights, on one model, batch 1.

Every peer runs in its own child process (so one's allocations never count against another's),
with the checkpoint in the page cache. The parent samples each child's /proc/<pid>/status for the
peak of RssAnon (anonymous memory: what a process really allocates, as opposed to file pages
mapped zero-copy from the page cache) and reads its VmHWM (peak RSS) before it exits.

    layerstream bench                           # the ~0.5 GB bf16 benchmark Llama, bf16 and fp32
    layerstream bench --dtypes auto --png bench.png
    layerstream bench --model /path/to/model --budget-fraction 0.25
    layerstream bench --model model.gguf --peers resident,streaming --dtypes auto --budget-fraction 0.85
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from .common import (Chart, bench_main, bench_model_path, checkpoint_bytes, Child, fmt, machine_description,
                     mib, serve_commands, table, warm_page_cache)

PEERS = ("transformers", "resident", "streaming")
RSS_ANON_SLACK = 200 * 10**6  # target (b): streaming peak RssAnon <= budget + 200 MB (decimal, as stated)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="bench",
                   help="model folder, or 'bench' (default): a ~0.5 GB bf16 random Llama built once in "
                        "$LAYERSTREAM_BENCH_DIR or /var/tmp/layerstream-bench")
    p.add_argument("--dtypes", default="auto,float32",
                   help="compute dtypes to compare, comma-separated; auto = the checkpoint's (default: auto,float32)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"subset of {','.join(PEERS)}")
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="streaming peer's --max-device-memory as a fraction of the weights in the compute dtype")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per trial")
    p.add_argument("--trials", type=int, default=3, help="timed generations per peer (median reported)")
    p.add_argument("--threads", type=int, default=0, help="torch threads in every peer (0: torch's default)")
    p.add_argument("--png", default=None, help="write a bar chart of the results to this file")
    p.add_argument("--json", default=None, help="write the raw results to this file")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per peer")
    # internal: run one peer in this process and print its result as one JSON line
    p.add_argument("--peer", choices=PEERS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)


def prompt_ids(n: int) -> list[int]:
    # Fixed ids inside every tokenizer's first 500 entries, past the special tokens.
    return [(i * 37 + 11) % 490 + 10 for i in range(n)]


def weight_bytes(folder: Path, dtype_name: str) -> tuple[int, str]:
    """Bytes of the weights in the compute dtype, and that dtype's name. A GGUF file's: its blocks and
    globals in the form the planner counts (packed blocks in their compute form)."""
    from engine.args import resolve_dtype
    from engine.arch import load_model_config
    from engine.weights import ModelCheckpoint
    from engine.weights.probes import open_checkpoint

    if folder.is_file():
        checkpoint = ModelCheckpoint(folder)
        try:
            dtype = resolve_dtype(dtype_name, checkpoint.cfg.checkpoint_dtype)
            sizes = checkpoint.sizes(dtype)
            return (checkpoint.cfg.num_layers * sizes.block_bytes + sizes.global_bytes,
                    str(dtype).replace("torch.", ""))
        finally:
            checkpoint.close()

    cfg = load_model_config(folder)
    dtype = resolve_dtype(dtype_name, cfg.checkpoint_dtype)
    reader = open_checkpoint(folder)
    try:
        numel = sum(reader.tensor(n).numel for n in reader.names())
    finally:
        reader.close()
    return numel * dtype.itemsize, str(dtype).replace("torch.", "")


# -- one peer, in a child process --------------------------------------------------------------

def _now() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _trial(start: tuple[float, float], times: list[tuple[float, float]]) -> dict:
    """times: (wall, process CPU) at each generated token. CPU time per token (all threads of the
    process) is reported beside wall time: on a shared machine it is far less noisy."""
    n = len(times) - 1
    return {"ttft_s": times[0][0] - start[0], "decode_tok_s": n / (times[-1][0] - times[0][0]),
            "cpu_ms_per_token": 1e3 * (times[-1][1] - times[0][1]) / n}


def _transformers_peer(ns, ids: list[int]):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from engine.args import DTYPE_NAMES

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[tuple[float, float]] = []
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:  # the first call carries the prompt
                self.times.append(_now())

        def end(self):
            pass

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype="auto" if ns.dtype == "auto" else DTYPE_NAMES[ns.dtype])
    model.eval()
    load_s = time.perf_counter() - t0
    inp = torch.tensor([ids])

    def generate(n: int) -> dict:
        clock = Clock()
        start = _now()
        with torch.inference_mode():
            model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, streamer=clock, pad_token_id=0)
        return _trial(start, clock.times)

    generate(4)  # warm-up: first-call allocations and kernel selection
    info = {"load_s": load_s, "dtype": str(model.dtype).replace("torch.", "")}
    return info, lambda: generate(ns.max_tokens), lambda: {}


def _layerstream_peer(ns, ids: list[int]):
    from engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams

    budget = ns.budget if ns.peer == "streaming" else None
    t0 = time.perf_counter()
    engine = LLMEngine(EngineArgs(
        model=ns.model, dtype=ns.dtype, max_device_memory=budget, max_model_len=len(ids) + ns.max_tokens + 16,
        max_num_seqs=1, max_num_batched_tokens=max(512, len(ids)), show_progress=False))
    load_s = time.perf_counter() - t0
    plan = engine.plan

    def generate(n: int) -> dict:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = _now()
        engine.add_request(ids, params)
        times = []
        while engine.has_unfinished():
            for out in engine.step():
                times += [_now()] * len(out.new_token_ids)
        return _trial(start, times)

    generate(4)
    before = engine.telemetry().total
    trials = []

    def trial() -> dict:
        trials.append(1)
        return generate(ns.max_tokens)

    def done() -> dict:
        stats = engine.telemetry().total.since(before)
        steps = max(1, len(trials) * ns.max_tokens)
        engine.close()
        return {"stall_ms_per_step": 1e3 * stats.stall_seconds / steps,
                "prepare_ms_per_step": 1e3 * stats.prepare_seconds / steps}

    info = {"load_s": load_s, "dtype": engine.telemetry().dtype,
            "resident_blocks": len(plan.resident_blocks), "streamed_blocks": len(plan.streamed_blocks),
            "planned_bytes": plan.device_bytes}
    return info, trial, done


def _run_peer(ns) -> int:
    import torch

    if ns.threads:
        torch.set_num_threads(ns.threads)
    ids = prompt_ids(ns.prompt_tokens)
    make = _transformers_peer if ns.peer == "transformers" else _layerstream_peer
    info, trial, done = make(ns, ids)
    info.update(peer=ns.peer, threads=torch.get_num_threads())
    serve_commands({"trial": trial, "done": done}, info)
    return 0


# -- the parent: run every peer, print the table and ratios ----------------------------------------

def run(ns: argparse.Namespace) -> int:
    if ns.peer:
        return _run_peer(ns)
    if not 0 < ns.budget_fraction <= 1:
        raise ValueError(f"--budget-fraction must be in (0, 1], got {ns.budget_fraction}")
    if ns.trials < 1 or ns.max_tokens < 2 or ns.prompt_tokens < 1:
        raise ValueError("--trials >= 1, --max-tokens >= 2 and --prompt-tokens >= 1 are required")
    peers = [p.strip() for p in ns.peers.split(",") if p.strip()]
    for p in peers:
        if p not in PEERS:
            raise ValueError(f"unknown peer {p!r}; choose from {', '.join(PEERS)}")
    folder = bench_model_path() if ns.model == "bench" else Path(ns.model)
    if not (folder.is_dir() or (folder.is_file() and folder.suffix == ".gguf")):
        raise FileNotFoundError(f"model folder (or .gguf file) {folder} does not exist")
    if folder.is_file() and "transformers" in peers:
        raise ValueError("the transformers peer reads a safetensors folder; "
                         "use --peers resident,streaming for a GGUF file")
    ckpt = checkpoint_bytes(folder)
    print(f"model: {folder} ({ckpt / 1e9:.2f} GB of {'GGUF' if folder.is_file() else 'safetensors'})")
    print(f"machine: {machine_description()}")
    print(f"batch 1, prompt {ns.prompt_tokens} tokens, {ns.max_tokens} generated tokens, file in page cache "
          f"({warm_page_cache(folder):.1f} s to read it); {ns.trials} trials per peer, interleaved across "
          "peers (each in its own process), median reported")

    results: list[dict] = []
    for dtype_name in [d.strip() for d in ns.dtypes.split(",") if d.strip()]:
        results += _compare(ns, folder, dtype_name, peers)
    print()
    print(report(results, ns.budget_fraction))
    if ns.json:
        import json

        Path(ns.json).write_text(json.dumps(results, indent=2))
    if ns.png:
        chart(results, folder.name).save(ns.png)
        print(f"\nchart written to {ns.png}")
    return 0


def _compare(ns, folder: Path, dtype_name: str, peers: list[str]) -> list[dict]:
    """Load every peer (each in its own process, one after the other), then run the trials round
    by round, one peer at a time, so that load from elsewhere on the machine hits them alike."""
    weights, dtype = weight_bytes(folder, dtype_name)
    budget = int(ns.budget_fraction * weights)
    children: dict[str, Child] = {}
    infos: dict[str, dict] = {}
    try:
        for peer in peers:
            warm_page_cache(folder)
            argv = [sys.executable, "-m", "layerstream.bench.offline", "--peer", peer, "--model", str(folder),
                    "--dtype", dtype_name, "--prompt-tokens", str(ns.prompt_tokens), "--max-tokens",
                    str(ns.max_tokens), "--threads", str(ns.threads), "--budget", str(budget)]
            children[peer] = Child(argv, ns.timeout)
            infos[peer] = children[peer].read()
        trials: dict[str, list[dict]] = {p: [] for p in peers}
        for _ in range(ns.trials):
            for peer in peers:
                trials[peer].append(children[peer].ask("trial"))
        results = []
        for peer in peers:
            extra = children[peer].ask("done")
            peaks = children[peer].finish()
            ts = trials[peer]
            r = {**infos[peer], **extra, "compute": dtype, "weights": weights,
                 "budget": budget if peer == "streaming" else None,
                 "ttft_s": statistics.median(t["ttft_s"] for t in ts),
                 "decode_tok_s": statistics.median(t["decode_tok_s"] for t in ts),
                 "decode_all": [round(t["decode_tok_s"], 2) for t in ts],
                 "cpu_ms_per_token": statistics.median(t["cpu_ms_per_token"] for t in ts),
                 "peak_rss": peaks.rss, "peak_rss_anon": peaks.rss_anon}
            results.append(r)
            print(f"  {dtype:>8} {peer:<12} load {r['load_s']:5.2f} s  {r['decode_tok_s']:6.2f} tok/s (trials {r['decode_all']})  "
                  f"CPU {r['cpu_ms_per_token']:5.1f} ms/token  prefetch thread {r.get('prepare_ms_per_step', 0):6.2f} "
                  f"ms/step  TTFT {r['ttft_s'] * 1e3:5.0f} ms  peak RSS {mib(peaks.rss)} MiB  "
                  f"peak RssAnon {mib(peaks.rss_anon)} MiB", flush=True)
        return results
    finally:
        for child in children.values():
            child.kill()


def _label(r: dict) -> str:
    if r["peer"] == "streaming":
        return f"layerstream streaming ({r['streamed_blocks']}/{r['resident_blocks'] + r['streamed_blocks']} blocks streamed)"
    return {"transformers": "transformers", "resident": "layerstream all resident"}[r["peer"]]


def report(results: list[dict], fraction: float) -> str:
    rows = []
    for r in results:
        budget = f"{mib(r['budget'])} MiB" if r.get("budget") else "-"
        rows.append([r["compute"], _label(r), budget, fmt(r["decode_tok_s"]), fmt(r["cpu_ms_per_token"], 1),
                     f"{r['ttft_s'] * 1e3:.0f}",
                     mib(r["peak_rss"]), mib(r["peak_rss_anon"])])
    out = [table(["compute", "peer", "budget", "decode tok/s", "CPU ms/token", "TTFT ms", "peak RSS MiB", "peak RssAnon MiB"], rows)]
    out.append("")
    for dtype in dict.fromkeys(r["compute"] for r in results):
        by = {r["peer"]: r for r in results if r["compute"] == dtype}
        lines = [f"{dtype}: weights {mib(next(iter(by.values()))['weights'])} MiB"]
        hf, res, st = by.get("transformers"), by.get("resident"), by.get("streaming")
        if hf and res:
            lines.append(f"resident / transformers decode = {res['decode_tok_s'] / hf['decode_tok_s']:.2f}x"
                         f" (by CPU time per token {hf['cpu_ms_per_token'] / res['cpu_ms_per_token']:.2f}x)"
                         f"   TTFT {res['ttft_s'] / hf['ttft_s']:.2f}x")
        if res and st:
            lines.append(f"streaming / resident decode = {st['decode_tok_s'] / res['decode_tok_s']:.2f}x"
                         f" (by CPU time per token {res['cpu_ms_per_token'] / st['cpu_ms_per_token']:.2f}x)")
        if hf and st:
            lines.append(f"streaming / transformers decode = {st['decode_tok_s'] / hf['decode_tok_s']:.2f}x"
                         f"   peak RssAnon {st['peak_rss_anon'] / hf['peak_rss_anon']:.2f}x")
        if st:
            limit = st["budget"] + RSS_ANON_SLACK
            lines.append(f"streaming peak RssAnon {mib(st['peak_rss_anon'])} MiB vs budget "
                         f"({fraction:.0%} of weights) + 200 MB = {mib(limit)} MiB: "
                         f"{'within' if st['peak_rss_anon'] <= limit else 'OVER'}")
        out.append("  ".join(lines[:1]) + "\n  " + "\n  ".join(lines[1:]))
    return "\n".join(out)


def chart(results: list[dict], model_name: str) -> Chart:
    c = Chart(f"{model_name}: batch 1 decode, file in page cache (grey: transformers, blue: layerstream "
              "resident, orange: layerstream streaming)")
    short = {"transformers": "HF", "resident": "resident", "streaming": "streaming"}
    labels = [f"{r['compute']}\n{short[r['peer']]}" for r in results]
    groups = [PEERS.index(r["peer"]) for r in results]
    c.add("decode tokens/s", labels, [r["decode_tok_s"] for r in results], groups)
    c.add("CPU ms per token", labels, [r["cpu_ms_per_token"] for r in results], groups)
    c.add("time to first token (ms)", labels, [r["ttft_s"] * 1e3 for r in results], groups)
    c.add("peak RSS (MiB)", labels, [r["peak_rss"] / 2**20 for r in results], groups)
    c.add("peak RssAnon (MiB)", labels, [r["peak_rss_anon"] / 2**20 for r in results], groups)
    return c


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m layerstream.bench.offline", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
