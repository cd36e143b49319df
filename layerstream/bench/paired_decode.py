"""bench-scale's paired decode: both peers in one process, decoding in alternating rounds.

A shared machine's memory can change speed within a minute (docs/benchmarks/scale.md has a VM that reads at one of
two speeds), so two peers timed in runs of their own, even alternating runs, can each draw a different speed, and the
ratio of their fastest runs then says as much about the draw as about the peers. Here one child process holds both,
layerstream's engine (prefix cache on) and llama-cpp-python's `Llama`, after each has served the prompt once and
layerstream's resident copies are in huge pages (a server's steady state). Each round both decode --decode-tokens
greedy tokens after that prompt, served from their prefix caches (llama.cpp reuses its longest matching prefix), a
fraction of a second apart, the order reversed every round: each round's ratio compares the two under nearly the same
memory. The median of the rounds' ratios is the figure; their range shows the spread.

Then --floor-rounds more rounds set each peer against the memory floor at the memory's speed of the moment: between
two tokens the child reads PROBE_BYTES of memory (a torch sum, the threads the peers use), and each token's floor is
its weight bytes over the faster of the reads just before and just after it. A token takes tens to hundreds of
milliseconds and the memory's speed holds for seconds, so the floor and the token see the same memory, where a probe
before and after a whole run (bench-scale's separate runs) may not. The share of the floor is the tokens' floor time
over their time (the reads are not counted in it); the median over the rounds is the figure. These rounds are not in
the ratio: a torch read's threads may still spin when llama.cpp's next token starts.

Both files are mapped in one process, so the pair runs only where both fit in the memory available together.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from .common import checkpoint_bytes, idle_until_collapsed

PAUSE_S = 0.3  # between two decodes: the threads of the one that ran stop spinning before the other runs
PROBE_BYTES = 256 << 20  # read between two tokens in the floor rounds: long enough to time, short beside a token


def floor_share(tokens: Iterator[int], read_gbps: Callable[[], float], bytes_per_token: int) -> tuple[float, float]:
    """Decodes by drawing from `tokens` (each item: how many tokens that draw decoded), calling read_gbps() between
    two draws -> (tok/s, the share of the memory floor reached). The first draw finishes the prompt and is not
    counted; each later token's floor is bytes_per_token at the faster of the reads just before and after it."""
    draws = iter(tokens)
    next(draws)
    before, spent, floor, count = read_gbps(), 0.0, 0.0, 0
    while True:
        t0 = time.perf_counter()
        n = next(draws, None)
        if n is None:
            break
        spent += time.perf_counter() - t0
        after = read_gbps()
        floor += n * bytes_per_token / (max(before, after) * 1e9)
        count, before = count + n, after
    if not count:
        raise ValueError("no token after the first to set against the floor")
    return count / spent, floor / spent


def summarize(rounds: list[tuple[float, float]]) -> dict:
    """Each round's (layerstream, llama.cpp) decode tok/s -> the medians of each, and of the rounds' ratios with
    their range."""
    if not rounds:
        raise ValueError("no paired rounds to summarize")
    ratios = [mine / theirs for mine, theirs in rounds]
    return dict(rounds=len(rounds), layerstream_tps=statistics.median(m for m, _ in rounds),
                llama_cpp_tps=statistics.median(t for _, t in rounds), ratio=statistics.median(ratios),
                ratio_min=min(ratios), ratio_max=max(ratios))


def summarize_floor(shares: list[tuple[float, float]]) -> dict:
    """Each floor round's (layerstream, llama.cpp) share of the memory floor -> each peer's median and range."""
    if not shares:
        return {}
    mine, theirs = [m for m, _ in shares], [t for _, t in shares]
    return dict(floor_rounds=len(shares), layerstream_floor=statistics.median(mine), layerstream_floor_min=min(mine),
                layerstream_floor_max=max(mine), llama_cpp_floor=statistics.median(theirs),
                llama_cpp_floor_min=min(theirs), llama_cpp_floor_max=max(theirs))


def floor_text(s: dict, peer: str) -> str:
    """A peer's ("layerstream" or "llama_cpp") median share of the floor in the floor rounds with its range, as
    "80% (70-90%)"; "" where none ran."""
    if not s.get("floor_rounds"):
        return ""
    return f"{100 * s[f'{peer}_floor']:.0f}% ({100 * s[f'{peer}_floor_min']:.0f}-{100 * s[f'{peer}_floor_max']:.0f}%)"


def describe(s: dict) -> str:
    """The summary as bench-scale prints it."""
    text = (f"layerstream {s['layerstream_tps']:.1f}, llama.cpp {s['llama_cpp_tps']:.1f} tok/s (medians of "
            f"{s['rounds']} rounds); per round {s['ratio']:.2f}x median ({s['ratio_min']:.2f}-{s['ratio_max']:.2f}x)")
    if s.get("floor_rounds"):
        text += (f"; of the memory floor read between tokens, medians of {s['floor_rounds']} rounds: layerstream "
                 f"{floor_text(s, 'layerstream')}, llama.cpp {floor_text(s, 'llama_cpp')}")
    return text


def fits_together(mine: Path, theirs: Path) -> bool:
    """Whether both peers' files fit the memory available now with room to spare (each maps its file whole)."""
    from engine.host_memory import host_memory_available

    return checkpoint_bytes(mine) + checkpoint_bytes(theirs) < 0.8 * host_memory_available()


def child(spec: dict) -> dict:
    """In the child process: spec = {mine, theirs, ids, threads, decode_tokens, rounds, idle, floor_rounds,
    bytes_per_token: [mine, theirs]}."""
    import torch
    from llama_cpp import Llama

    from engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams

    ids, n = spec["ids"], spec["decode_tokens"]
    torch.set_num_threads(spec["threads"])
    engine = LLMEngine(EngineArgs(model=spec["mine"], device="cpu", max_num_seqs=1, max_model_len=len(ids) + n + 16,
                                  max_num_batched_tokens=len(ids), show_progress=False, enable_prefix_caching=True))
    llm = None

    def my_tokens() -> Iterator[int]:  # each step's new tokens
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), f"paired-{time.time()}")
        while engine.has_unfinished():
            new = sum(len(out.new_token_ids) for out in engine.step())
            if new:
                yield new

    def their_tokens() -> Iterator[int]:
        for count, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True), 1):
            yield 1
            if count == n:
                return

    def tps(tokens: Iterator[int]) -> float:  # from the first token to the last
        next(tokens)
        t0, count = time.perf_counter(), sum(tokens)
        return count / (time.perf_counter() - t0) if count else 0.0

    probe = torch.ones(PROBE_BYTES // 4, dtype=torch.float32)

    def read_gbps() -> float:
        t0 = time.perf_counter()
        probe.sum()
        return PROBE_BYTES / (time.perf_counter() - t0) / 1e9

    try:
        llm = Llama(model_path=spec["theirs"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                    n_batch=len(ids), n_ctx=len(ids) + n + 16, verbose=False)
        tps(my_tokens()), tps(their_tokens())  # each computes the prompt once; every round after reads it cached
        idle_until_collapsed(engine, spec["idle"])
        mine_bytes, their_bytes = spec["bytes_per_token"]
        peers = {"mine": (my_tokens, mine_bytes), "theirs": (their_tokens, their_bytes)}

        def alternate(i: int) -> tuple[str, str]:  # the order, reversed every round
            return ("mine", "theirs") if i % 2 == 0 else ("theirs", "mine")

        rounds, shares = [], []
        for i in range(spec["rounds"]):
            speeds = {}
            for name in alternate(i):
                time.sleep(PAUSE_S)
                speeds[name] = tps(peers[name][0]())
            rounds.append((speeds["mine"], speeds["theirs"]))
        for i in range(spec["floor_rounds"]):
            share = {}
            for name in alternate(i):
                time.sleep(PAUSE_S)
                tokens, nbytes = peers[name]
                share[name] = floor_share(tokens(), read_gbps, nbytes)[1]
            shares.append((share["mine"], share["theirs"]))
        return dict(rounds_tps=rounds, floor_shares=shares)
    finally:
        if llm is not None:
            llm.close()
        engine.close()


def run_paired(ns, mine: Path, theirs: Path, ids: list[int], bytes_per_token: tuple[int, int]) -> dict:
    """The paired child's summary (summarize's and summarize_floor's keys, rounds_tps and floor_shares), or
    {"error": why}. bytes_per_token: the weight bytes a token reads from each peer's file."""
    if not fits_together(mine, theirs):
        return {"error": "both files do not fit in memory together"}
    spec = dict(mine=str(mine), theirs=str(theirs), ids=ids, threads=ns.threads, decode_tokens=ns.decode_tokens,
                rounds=ns.paired_rounds, idle=ns.idle, floor_rounds=ns.floor_rounds,
                bytes_per_token=list(bytes_per_token))
    argv = [sys.executable, "-m", "layerstream", "--log-level", "WARNING", "bench-scale", "--child", "paired"]
    try:
        proc = subprocess.run(argv, input=json.dumps(spec), capture_output=True, text=True, timeout=ns.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result in {ns.timeout:.0f} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        return {"error": f"exit {proc.returncode}: {tail[0]}"}
    out = json.loads(lines[-1])
    rounds, shares = [tuple(r) for r in out["rounds_tps"]], [tuple(r) for r in out["floor_shares"]]
    return dict(summarize(rounds), **summarize_floor(shares), rounds_tps=rounds, floor_shares=shares)
