"""`layerstream bench-disk`: a model larger than RAM, transformers vs layerstream under a memory cgroup.

Each peer runs as a child process placed (before it imports anything) in a cgroup v1 memory
cgroup capped at about half the checkpoint's size, with the page cache dropped before it starts,
so every byte a decode step needs that does not fit under the cap comes from disk:
  transformers          from_pretrained + manual greedy decode; its weights are mmap-backed, so
                        under the cap it pages them in (and out) on demand
  layerstream           the planner keeps what fits in RAM and reads the rest from disk each step
                        (the disk tier: O_DIRECT reads ahead of compute)
  layerstream-uncapped  no cap, every block resident: the reference for identical tokens
  layerstream-gguf      with --gguf FILE: a packed (e.g. Q4) GGUF of the same model under the same cap;
                        its disk tier reads the packed bytes (different weights, so its tokens are
                        compared with its own uncapped run when that peer is listed too)
  layerstream-gguf-uncapped  that GGUF with no cap

    layerstream bench-disk --model BF16_FOLDER --gguf Q4_FILE --cap 700MB \
        --peers layerstream,layerstream-gguf,layerstream-uncapped,layerstream-gguf-uncapped
Reported per peer: decode tok/s, bytes read from disk per decode token (/proc/<pid>/io
read_bytes), the GB/s that makes, and that as a % of the disk's sequential read speed measured
first on the checkpoint itself (the disk floor: bytes per token / measured GB/s).

Needs root (cgroup v1 memory controller and /proc/sys/vm/drop_caches writable); elsewhere it
prints why and skips.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT, cached_random_model, read_status, table

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
PEERS = ("transformers", "layerstream", "layerstream-uncapped", "layerstream-gguf", "layerstream-gguf-uncapped")
PROMPT = "Once upon a time there was a small model that dreamed of being large. It read its weights from disk"


def bench_model_config():
    """A Llama of ~1.66B parameters, ~3.3 GB in bf16: 34 blocks of ~90 MB, a 32k vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=34, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )


def bench_model_path(root: Path = BENCH_ROOT) -> Path:
    """The ~3.3 GB checkpoint (building it needs ~10 GB RAM once, a few minutes)."""
    return cached_random_model("llama-3.3g-bf16", bench_model_config(), root, max_shard_size="2GB")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help=f"checkpoint folder (default: a ~3.3 GB bf16 Llama built once in {BENCH_ROOT})")
    p.add_argument("--cap", default="half",
                   help="memory cgroup limit: 'half' (of the checkpoint) or a size, e.g. 1.7GB")
    p.add_argument("--peers", default=",".join(PEERS[:3]), help=f"comma-separated, from {', '.join(PEERS)}")
    p.add_argument("--gguf", default=None, help="a packed GGUF of the same model, for the layerstream-gguf peers")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--decode-tokens", type=int, default=8, help="greedy tokens per peer (the first is prefill's)")
    p.add_argument("--prefetch-depth", type=int, default=2, help="layerstream: blocks read ahead of compute")
    p.add_argument("--max-host-memory", default=None,
                   help="layerstream peers: plan with this host memory budget (e.g. 100MB) instead of what the "
                        "cgroup leaves at start-up; with a --cap roomy enough for the interpreter, both peers then "
                        "get the same budget for weights, buffers and KV, whatever their imports left in the cgroup")
    p.add_argument("--timeout", type=float, default=900, help="seconds allowed per peer")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ids", default=None, help=argparse.SUPPRESS)


# -- child side ---------------------------------------------------------------------------------

def read_bytes() -> int:
    """Bytes this process (all its threads) caused to be read from storage: page faults,
    readahead and O_DIRECT reads; page-cache hits do not count."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no read_bytes")


def peak_rss() -> int:
    """This process's peak resident set (VmHWM): anonymous memory plus mapped file pages."""
    return read_status(os.getpid()).get("VmHWM", 0)


def _child_transformers(model: str, ids: list[int], n: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    m.eval()
    load_s = time.perf_counter() - t0
    tokens = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = m(input_ids=torch.tensor([ids]), use_cache=True)  # (1, prompt, vocab)
        tokens.append(int(out.logits[0, -1].argmax()))
        first, io0 = time.perf_counter(), read_bytes()
        for _ in range(n - 1):
            out = m(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
        end, io1 = time.perf_counter(), read_bytes()
    return dict(tokens=tokens, load_s=load_s, ttft_s=first - t0, decode_s=end - first, decode_read_bytes=io1 - io0,
                peak_rss=peak_rss())


def _child_layerstream(model: str, ids: list[int], n: int, depth: int, max_host_memory: str | None) -> dict:
    from engine import EngineArgs, LLMEngine
    from engine.kernels.ggml_repack import ggml_repack
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=model, max_num_seqs=1, max_model_len=len(ids) + n + 16,
                                  max_num_batched_tokens=max(64, len(ids)), prefetch_depth=depth,
                                  max_host_memory=max_host_memory, show_progress=False))
    load_s = time.perf_counter() - t0
    plan = engine.plan
    t0 = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), "bench")
    tokens, first, io0, before = [], None, 0, None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if first is None:
                first, io0, before = time.perf_counter(), read_bytes(), engine.telemetry().total
    end, io1 = time.perf_counter(), read_bytes()
    stream = engine.telemetry().total.since(before)
    result = dict(tokens=tokens, load_s=load_s, ttft_s=first - t0, decode_s=end - first, decode_read_bytes=io1 - io0,
                  stall_s=stream.stall_seconds, reader_busy_s=stream.disk_read_seconds,
                  peak_rss=peak_rss(), resident_blocks=len(plan.resident_blocks),
                  host_blocks=len(plan.host_blocks), disk_blocks=len(plan.disk_blocks),
                  planned_disk_bytes_per_step=plan.disk_bytes_per_step, plan=plan.describe(),
                  stream_repack=ggml_repack() is not None)
    engine.close()
    if plan.disk_blocks:
        result.update(zip(("read_only_bytes", "read_only_s"), _read_only_pass(model, plan.disk_blocks)))
    return result


def _read_only_pass(model: str, blocks: list[int]) -> tuple[int, float]:
    """One step's disk reads again, same reader, same files, nothing else running in this process:
    the speed the disk gives this access pattern right now, a second measure of the floor taken
    seconds after the decode (the standalone measurements can land in a slower minute)."""
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(model)
    try:
        return checkpoint.time_disk_reads(blocks)
    finally:
        checkpoint.close()


def _child(ns: argparse.Namespace) -> int:
    ids = [int(t) for t in ns.ids.split(",")]
    if ns.child == "transformers":
        result = _child_transformers(ns.model, ids, ns.decode_tokens)
    else:
        result = _child_layerstream(ns.model, ids, ns.decode_tokens, ns.prefetch_depth, ns.max_host_memory)
    print(json.dumps(result))
    return 0


# -- parent side --------------------------------------------------------------------------------

def cgroups_unavailable() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if not (CGROUP_ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 memory controller at {CGROUP_ROOT} (cgroup v2-only or not Linux)"
    probe = CGROUP_ROOT / f"layerstream-probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return f"cannot create a memory cgroup under {CGROUP_ROOT}: {e.strerror} (run as root)"
    if not os.access(DROP_CACHES, os.W_OK):
        return f"cannot write {DROP_CACHES} to drop the page cache (run as root)"
    return None


def drop_page_cache() -> None:
    os.sync()
    DROP_CACHES.write_text("1\n")


class MemoryCgroup:
    def __init__(self, name: str, limit: int | None):
        self.path = CGROUP_ROOT / name
        self.path.mkdir()
        if limit is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))

    def join_fn(self):
        procs = self.path / "cgroup.procs"
        # Runs in the child between fork and exec: it is capped before the interpreter starts.
        return lambda: procs.write_text(str(os.getpid()))

    def stat(self) -> dict:
        def read(name):
            try:
                return (self.path / name).read_text()
            except OSError:
                return ""
        oom = {k: int(v) for k, v in (ln.split() for ln in read("memory.oom_control").splitlines()) if v.isdigit()}
        return dict(max_usage=int(read("memory.max_usage_in_bytes") or 0), failcnt=int(read("memory.failcnt") or 0),
                    oom_kills=oom.get("oom_kill", 0))

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def _run_peer(ns, peer: str, model: Path, ids: list[int], cap: int | None) -> dict:
    drop_page_cache()
    if peer.startswith("layerstream-gguf"):
        model = Path(ns.gguf)
    cg = MemoryCgroup(f"layerstream-bench-{os.getpid()}-{peer}", cap)
    argv = [sys.executable, "-m", "layerstream", "--log-level", "WARNING", "bench-disk", "--child",
            "transformers" if peer == "transformers" else "layerstream", "--model", str(model),
            "--ids", ",".join(map(str, ids)), "--decode-tokens", str(ns.decode_tokens),
            "--prefetch-depth", str(ns.prefetch_depth)]
    if ns.max_host_memory and peer in ("layerstream", "layerstream-gguf"):
        argv += ["--max-host-memory", ns.max_host_memory]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(argv, preexec_fn=cg.join_fn(), capture_output=True, text=True, timeout=ns.timeout,
                              cwd=Path(__file__).resolve().parent.parent)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = "timeout", "", (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else ""
    stat = cg.stat()
    cg.remove()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    res = json.loads(lines[-1]) if rc == 0 and lines else {}
    res.update(peer=peer, cap=cap, rc=rc, wall_s=time.perf_counter() - t0, **stat)
    if not lines or rc != 0:
        res["error"] = ("OOM-killed under the cap" if stat["oom_kills"] or rc == -9 else f"exit {rc}")
        res["stderr_tail"] = err[-2000:]
    return res


def _floor_columns(r: dict, gbps: float) -> tuple[str, str, str, str]:
    n = len(r.get("tokens", [])) - 1
    if n < 1:
        return "-", "-", "-", "-"
    tps = n / r["decode_s"]
    per_tok = r["decode_read_bytes"] / n
    achieved = r["decode_read_bytes"] / r["decode_s"] / 1e9
    pct = f"{100 * achieved / gbps:.0f}%" if per_tok > (1 << 20) else "- (cached)"
    return f"{tps:.3f}", f"{per_tok / 1e9:.2f}", f"{achieved:.2f}", pct


def _first_difference(a: dict, b: dict) -> int:
    return next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y),
                min(len(a["tokens"]), len(b["tokens"])))


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def run(ns: argparse.Namespace) -> int:
    if ns.child:
        return _child(ns)
    why = cgroups_unavailable()
    if why:
        print(f"bench-disk: skipped: {why}")
        return 0
    peers = [p.strip() for p in ns.peers.split(",") if p.strip()]
    for p in peers:
        if p not in PEERS:
            raise ValueError(f"unknown peer {p!r}; choose from {', '.join(PEERS)}")
    if any(p.startswith("layerstream-gguf") for p in peers) and not ns.gguf:
        raise ValueError("the layerstream-gguf peers need --gguf FILE")
    if ns.decode_tokens < 2:
        raise ValueError(f"--decode-tokens must be >= 2 (the first token is prefill's), got {ns.decode_tokens}")
    from engine.weights.probes import measure_disk_bandwidth
    from engine.planner import format_bytes, parse_bytes

    model = Path(ns.model) if ns.model else bench_model_path()
    files = sorted(model.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    cap = size // 2 if ns.cap == "half" else parse_bytes(ns.cap)
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).encode(PROMPT * 4)[:ns.prompt_tokens]
    # The floor: the disk's own sequential speed on this checkpoint. It moves from minute to minute
    # here (a shared virtual disk), so it is measured right before each peer and once after the last;
    # each peer is held to the faster of the two measurements around it, so "% of floor" errs
    # against the peer, never for it. Each measurement is cached: the layerstream child plans with it.
    measure = lambda: measure_disk_bandwidth(files, use_cache=False, max_bytes=1 << 30, max_seconds=8.0)  # noqa: E731
    print(f"checkpoint {model} ({size / 1e9:.2f} GB), cap {format_bytes(cap)} ({cap / size:.0%} of it), "
          f"{len(ids)} prompt tokens, {ns.decode_tokens} greedy tokens", flush=True)
    if ns.gguf:
        print(f"GGUF {ns.gguf} ({Path(ns.gguf).stat().st_size / 1e9:.2f} GB) under the same cap", flush=True)
    if ns.max_host_memory:
        print(f"layerstream peers plan with a host memory budget of {ns.max_host_memory}", flush=True)
    if any(p.startswith("layerstream") for p in peers):
        # The native kernels compile on first use, and a compile needs ~1 GB: built here, outside the
        # peers' cgroups, where it would fail under the cap and the child would silently take a fallback.
        from engine.kernels import int4_backend
        from engine.kernels.attention_ops import attention_ops
        from engine.kernels.decode_block import decode_block
        from engine.kernels.fused_ops import fused_ops
        from engine.kernels.ggml_repack import ggml_repack

        int4_backend(), fused_ops(), decode_block(), attention_ops(), ggml_repack()
    load_before = _loadavg()
    results, disk = [], [measure()]
    for peer in peers:
        print(f"  disk: {disk[-1].describe()}", flush=True)
        r = _run_peer(ns, peer, model, ids, None if peer.endswith("-uncapped") else cap)
        results.append(r)
        print(f"  {peer}: {r.get('error') or 'ok'} in {r['wall_s']:.0f} s", flush=True)
        if "error" in r:
            print("    " + r["stderr_tail"].strip().replace("\n", "\n    "), flush=True)
        if r.get("plan"):
            print("    " + r["plan"].replace("\n", "\n    "), flush=True)
        if peer == "layerstream-gguf" and "stream_repack" in r:
            print("    streamed GGUF blocks: " + ("repacked for the VNNI kernels (engine/weights/packed/stream_repack.py)"
                                                 if r["stream_repack"] else "dequantized by each matmul (fallback)"),
                  flush=True)
        if "reader_busy_s" in r and "error" not in r:
            rate = r["decode_read_bytes"] / r["reader_busy_s"] / 1e9 if r["reader_busy_s"] else 0.0
            print(f"    decode {r['decode_s']:.1f} s: disk reads in progress {r['reader_busy_s']:.1f} s "
                  f"({rate:.2f} GB/s while in progress), compute waiting for a block {r['stall_s']:.1f} s", flush=True)
        disk.append(measure())
        r["floor_gbps"] = max(disk[-2].gbps, disk[-1].gbps)
        if r.get("read_only_s"):
            r["read_only_gbps"] = r["read_only_bytes"] / r["read_only_s"] / 1e9
            print(f"    read-only pass over one step's disk blocks after the decode: {r['read_only_gbps']:.2f} GB/s",
                  flush=True)
            r["floor_gbps"] = max(r["floor_gbps"], r["read_only_gbps"])
    print(f"  disk: {disk[-1].describe()}", flush=True)
    ok = [r for r in results if "error" not in r and not r["peer"].startswith("layerstream-gguf")]
    ref = next((r for r in ok if r["peer"] == "layerstream-uncapped"), ok[0] if ok else None)
    gguf_ref = next((r for r in results if r["peer"] == "layerstream-gguf-uncapped" and "error" not in r), None)
    rows = []
    for r in results:
        packed = r["peer"].startswith("layerstream-gguf")
        tps, per_tok, achieved, pct = _floor_columns(r, r["floor_gbps"])
        if "error" in r:
            same = r["error"]
        elif r is ref or r is gguf_ref:
            same = "(reference)"
        elif packed and gguf_ref is None:
            same = "- (other weights)"
        else:
            other = gguf_ref if packed else ref
            same = "yes" if r["tokens"] == other["tokens"] else f"no (first differs at {_first_difference(r, other)})"
        cap_s = "none" if r["cap"] is None else f"{r['cap'] / 1e9:.2f} GB"
        if ns.max_host_memory and r["peer"] in ("layerstream", "layerstream-gguf"):
            cap_s += f", budget {ns.max_host_memory}"
        busy = (f"{100 * r['reader_busy_s'] / r['decode_s']:.0f}%"
                if r.get("disk_blocks") and r.get("decode_s") else "-")
        rss = f"{r['peak_rss'] / 1e9:.2f} GB" if r.get("peak_rss") else "-"
        rows.append([r["peer"], cap_s, tps, per_tok, achieved, f"{r['floor_gbps']:.2f}", pct, busy, rss,
                     f"{r['max_usage'] / 1e9:.2f} GB", same])
    print()
    print(table(["peer", "memory cap", "decode tok/s", "disk GB/token", "achieved GB/s", "disk GB/s",
                     "% of disk floor", "reads in flight", "peak RSS", "cgroup peak",
                     f"tokens identical to {ref['peer'] if ref else '-'}"], rows))
    by = {r["peer"]: r for r in results if "error" not in r}
    if "layerstream-gguf" in by and "layerstream" in by:
        speed = lambda r: (len(r["tokens"]) - 1) / r["decode_s"]  # noqa: E731
        per_tok = lambda r: r["decode_read_bytes"] / (len(r["tokens"]) - 1)  # noqa: E731
        print(f"\nGGUF / bf16 under the same cap: decode speed {speed(by['layerstream-gguf']) / speed(by['layerstream']):.2f}x, "
              f"disk bytes per token {per_tok(by['layerstream-gguf']) / max(per_tok(by['layerstream']), 1):.2f}x")
    if "transformers" in by and "layerstream" in by:
        speed = lambda r: (len(r["tokens"]) - 1) / r["decode_s"]  # noqa: E731
        print(f"\nlayerstream / transformers decode speed under the same cap: "
              f"{speed(by['layerstream']) / speed(by['transformers']):.2f}x (target >= 2x)")
    print("disk GB/s = the fastest of the disk measurements just before and just after the peer (and, for "
          "layerstream, of its read-only pass after the decode); "
          "% of floor = achieved GB/s / disk GB/s (target >= 70%); "
          "reads in flight = share of decode time the disk tier had reads outstanding (well under 100%: "
          "compute, not the disk, set the pace)")
    print(f"load average before / after: {load_before} / {_loadavg()} on {os.cpu_count()} CPUs "
          "(other processes share the machine: figures are noisy)")
    if ns.json:
        Path(ns.json).write_text(json.dumps({"disk": [d.__dict__ for d in disk], "prompt_ids": ids,
                                             "load_before": load_before, "load_after": _loadavg(),
                                             "results": results}, indent=1))
    return 0
