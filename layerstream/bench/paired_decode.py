"""bench-scale's paired decode: both peers in one process, decoding in alternating rounds.

A shared machine's memory can change speed within a minute (docs/benchmarks/scale.md has a VM that reads at one of
two speeds), so two peers timed in runs of their own, even alternating runs, can each draw a different speed, and the
ratio of their fastest runs then says as much about the draw as about the peers. Here one child process holds both,
layerstream's engine (prefix cache on) and llama-cpp-python's `Llama`, after each has served the prompt once and
layerstream's resident copies are in huge pages (a server's steady state). Each round both decode --decode-tokens
greedy tokens after that prompt, served from their prefix caches (llama.cpp reuses its longest matching prefix), a
fraction of a second apart, the order reversed every round: each round's ratio compares the two under nearly the same
memory. The median of the rounds' ratios is the figure; their range shows the spread.

Both files are mapped in one process, so the pair runs only where both fit in the memory available together.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import checkpoint_bytes, idle_until_collapsed

PAUSE_S = 0.3  # between two decodes: the threads of the one that ran stop spinning before the other runs


def summarize(rounds: list[tuple[float, float]]) -> dict:
    """Each round's (layerstream, llama.cpp) decode tok/s -> the medians of each, and of the rounds' ratios with
    their range."""
    if not rounds:
        raise ValueError("no paired rounds to summarize")
    ratios = [mine / theirs for mine, theirs in rounds]
    return dict(rounds=len(rounds), layerstream_tps=statistics.median(m for m, _ in rounds),
                llama_cpp_tps=statistics.median(t for _, t in rounds), ratio=statistics.median(ratios),
                ratio_min=min(ratios), ratio_max=max(ratios))


def describe(s: dict) -> str:
    """The summary as bench-scale prints it."""
    return (f"layerstream {s['layerstream_tps']:.1f}, llama.cpp {s['llama_cpp_tps']:.1f} tok/s (medians of "
            f"{s['rounds']} rounds); per round {s['ratio']:.2f}x median ({s['ratio_min']:.2f}-{s['ratio_max']:.2f}x)")


def fits_together(mine: Path, theirs: Path) -> bool:
    """Whether both peers' files fit the memory available now with room to spare (each maps its file whole)."""
    from engine.host_memory import host_memory_available

    return checkpoint_bytes(mine) + checkpoint_bytes(theirs) < 0.8 * host_memory_available()


def child(spec: dict) -> dict:
    """In the child process: spec = {mine, theirs, ids, threads, decode_tokens, rounds, idle}."""
    import torch
    from llama_cpp import Llama

    from engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams

    ids, n = spec["ids"], spec["decode_tokens"]
    torch.set_num_threads(spec["threads"])
    engine = LLMEngine(EngineArgs(model=spec["mine"], device="cpu", max_num_seqs=1, max_model_len=len(ids) + n + 16,
                                  max_num_batched_tokens=len(ids), show_progress=False, enable_prefix_caching=True))
    llm = None

    def mine() -> float:
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), f"paired-{time.time()}")
        first, count = None, 0
        while engine.has_unfinished():
            for out in engine.step():
                count += len(out.new_token_ids)
                first = first or time.perf_counter()
        return (count - 1) / (time.perf_counter() - first)

    def theirs() -> float:
        first, count = None, 0
        for _ in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            count += 1
            first = first or time.perf_counter()
            if count == n:
                break
        return (count - 1) / (time.perf_counter() - first)

    try:
        llm = Llama(model_path=spec["theirs"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                    n_batch=len(ids), n_ctx=len(ids) + n + 16, verbose=False)
        mine(), theirs()  # each computes the prompt once; every round after reads it from the prefix cache
        idle_until_collapsed(engine, spec["idle"])
        rounds = []
        for i in range(spec["rounds"]):
            speeds = {}
            for name, decode in ((("mine", mine), ("theirs", theirs)) if i % 2 == 0 else
                                 (("theirs", theirs), ("mine", mine))):
                time.sleep(PAUSE_S)
                speeds[name] = decode()
            rounds.append((speeds["mine"], speeds["theirs"]))
        return dict(rounds_tps=rounds)
    finally:
        if llm is not None:
            llm.close()
        engine.close()


def run_paired(ns, mine: Path, theirs: Path, ids: list[int]) -> dict:
    """The paired child's summary (summarize's keys and rounds_tps), or {"error": why}."""
    if not fits_together(mine, theirs):
        return {"error": "both files do not fit in memory together"}
    spec = dict(mine=str(mine), theirs=str(theirs), ids=ids, threads=ns.threads, decode_tokens=ns.decode_tokens,
                rounds=ns.paired_rounds, idle=ns.idle)
    argv = [sys.executable, "-m", "layerstream", "--log-level", "WARNING", "bench-scale", "--child", "paired"]
    try:
        proc = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True, timeout=ns.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {ns.timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    rounds = [tuple(r) for r in json.loads(lines[-1])["rounds_tps"]]
    return dict(summarize(rounds), rounds_tps=rounds)
