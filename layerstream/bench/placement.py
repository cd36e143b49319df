"""`layerstream bench-placement`: issue #38's per-step choice between computing off-device MLPs on the CPU and
streaming them, at a device budget below the model: --cpu-offload-policy stream, cpu and auto side by side,
with tensor groups placed (LAYERSTREAM_PLACEMENT=groups: attention, norms and KV of every layer on the device,
MLPs off it, the largest first).

The model: random bf16 weights with Llama-3.1-8B's shape (--shape 8b: hidden 4096, 32 layers, 32 query / 8 KV
heads, FFN 14336; SmolLM2's vocabulary), bench-scale's checkpoint under $LAYERSTREAM_BENCH_DIR/scale-<shape>/bf16
(built once, shard by shard, its random numbers drawn on the GPU when there is one; reused after). --shape tiny
is a smoke test of the benchmark itself.

The budget: --budget-fraction of the checkpoint's bytes (default 25%). Where the planner cannot place groups
there for every policy (attention, norms, globals, workspace and KV of every layer must fit on the device, and
stream buffers beside them for the policies that stream), the run says why and raises the budget to the least
whole percent at which every policy places groups, so that the three rows compare groups rather than whole
blocks.

Each policy runs in its own process (memory and CUDA state do not leak between them): a fresh engine with that
budget and policy, a warm-up request, then
  prefill   one --prompt-tokens prompt in one step: tok/s = prompt tokens / the step's seconds
  batch 1   --decode-tokens decode steps of that request, after two untimed ones: tok/s
  batch 16  --batch requests of --batch-prompt-tokens each, decoding together: --decode-tokens steps after two
            untimed ones, aggregate tok/s (every request's tokens)
Per row the columns are:
  tok/s             as above
  link MB/token     weight bytes streamed to the device per token (telemetry's PathStats, stream path)
  CPU-read MB/token weight bytes the CPU read to compute off-device MLPs, per token (groups computed on the CPU
                    x the MLP's bytes: each reads its weights once per step)
  floor tok/s       tokens / (link bytes / link GB/s + CPU-read bytes / host memory GB/s): the two do not overlap
                    in a dense model's step (the next block's attention needs this block's MLP); the link's
                    GB/s is the engine's own measurement (telemetry's LinkSpeeds; the simulated link's rate on
                    the CPU), the host's is bench-scale's memory_gbps; device-resident reads are not counted
  % of floor        tok/s / floor tok/s
  cpu / stream steps  steps in which at least one group took each path
The verdicts: auto against the better of stream and cpu in every row, and auto at batch 1 against
1.2x llama.cpp's -ngl run at the same device budget (llama-cpp-python with GPU offload and a GGUF of the same
weights: --gguf, or <shape>.BF16.gguf beside the checkpoint, as bench-scale makes it; otherwise "not
measured" and why). auto decides from the speeds the engine measures at start-up (engine/loader.py: the link,
the CPU on an off-device MLP's own weights, the device on a product of its shape) and refreshes as steps run;
the benchmark prints them (LLMEngine.measured_speeds) and sets none.

--device cpu runs the same on the simulated link (transport "simulated", LAYERSTREAM_SIM_GBPS), as the tests
do: the figures are simulated and say so.

    layerstream bench-placement                                   # on a GPU: the 8B shape, 25% (or raised)
    layerstream bench-placement --device cpu --shape tiny         # the dry run
    scripts/gpu_placement.sh                                      # the GPU session's one command for #38
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT, Chart, bench_main, fmt, machine_description, table

POLICIES = ("stream", "cpu", "auto")
ROWS = ("prefill", "batch 1", "batch N")
WARM_STEPS = 2  # decode steps before the timed ones: the first steps of a phase pay for kernel choices
# Tokens a request may decode past the timed window: requests whose prompts took different steps must all decode
# through it (they are aborted after it).
SPARE_TOKENS = 8


def max_tokens(ns) -> int:
    """Each measured request's max_tokens: its first token, the untimed steps, the timed ones, the spare."""
    return 1 + WARM_STEPS + ns.decode_tokens + SPARE_TOKENS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="8b", help="8b, 3b or tiny (bench-scale's shapes)")
    p.add_argument("--device", default="cuda", help="cuda, or cpu: the simulated link")
    p.add_argument("--budget-fraction", type=float, default=0.25,
                   help="device budget as a fraction of the checkpoint's bytes (raised where groups do not place)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="the prefill row's prompt")
    p.add_argument("--batch", type=int, default=16, help="requests decoding together in the batched row")
    p.add_argument("--batch-prompt-tokens", type=int, default=32, help="each batched request's prompt")
    p.add_argument("--decode-tokens", type=int, default=16, help="timed decode steps per row")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, from stream, cpu, auto")
    p.add_argument("--threads", type=int, default=None, help="CPU threads, torch's and the kernels' (default: torch's)")
    p.add_argument("--gguf", default=None, help="llama.cpp's file of the same weights (default: <shape>.BF16.gguf "
                   "beside the checkpoint, if bench-scale made it)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per policy's run")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--ngl", type=int, default=None, help=argparse.SUPPRESS)


def shape_config(shape: str):
    """bench-scale's shapes, but tiny with a vocabulary of 8192: with SmolLM2's 49152 the tiny model is mostly its
    embeddings, and no budget places groups (attention and globals on the device and MLPs off it) that the whole
    model does not fit; at 8192, as at 8B, the MLPs are most of the weights."""
    from .scale import shape_config as scale_shape

    config = scale_shape(shape)
    if shape == "tiny":
        config.vocab_size = 8192
    return config


def model_root(shape: str) -> Path:
    """bench-scale's folder for its shapes (an 8B checkpoint built by either is the other's); tiny's own."""
    return BENCH_ROOT / (f"placement-{shape}" if shape == "tiny" else f"scale-{shape}")


# -- one engine, as parent (plans) and child (runs) build it -----------------------------------------
def _kv_bytes(ns, cfg) -> int:
    """A KV pool that holds what the rows need, not max_num_seqs x max_model_len (at the 8B shape that pool
    alone would take over a third of a 25% budget): the prompt's request, or the batch's, in 16-token blocks."""
    heads, k_width, v_width = cfg.kv_cache_dims
    per_token = cfg.num_layers * heads * (k_width + v_width) * 2  # K and V of every layer, bf16
    blocks = lambda prompt: -(-(prompt + max_tokens(ns)) // 16)  # noqa: E731
    need = max(blocks(ns.prompt_tokens), ns.batch * blocks(ns.batch_prompt_tokens)) + 2 * ns.batch
    return need * 16 * per_token


def model_config(model: Path):
    """The checkpoint's ModelConfig, as the engine reads it."""
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(model)
    try:
        return checkpoint.cfg
    finally:
        checkpoint.close()


def engine_args(ns, model: Path, policy: str, budget: int):
    from engine import EngineArgs

    cfg = model_config(model)
    return EngineArgs(model=str(model), device=ns.device, transport="simulated" if ns.device == "cpu" else "auto",
                      max_device_memory=budget, cpu_offload_policy=policy, max_num_seqs=ns.batch,
                      max_model_len=max(ns.prompt_tokens, ns.batch_prompt_tokens) + max_tokens(ns),
                      max_num_batched_tokens=max(ns.prompt_tokens, ns.batch * ns.batch_prompt_tokens),
                      kv_cache_memory=_kv_bytes(ns, cfg), show_progress=False)


def _plans(ns, model: Path, budget: int) -> dict:
    """Each policy's plan at `budget` (the planner alone: nothing is loaded)."""
    from engine.args import resolve_dtype
    from engine.host_memory import host_budget
    from engine.loader import plan_for
    from engine.weights import ModelCheckpoint

    checkpoint = ModelCheckpoint(model)
    try:
        out = {}
        for policy in ns.policy_list:
            args = engine_args(ns, model, policy, budget)
            dtype = resolve_dtype(args.dtype, checkpoint.cfg.checkpoint_dtype)
            out[policy] = plan_for(args, checkpoint.cfg, checkpoint, dtype, host_budget(args.max_host_memory))
        return out
    finally:
        checkpoint.close()


def choose_budget(ns, model: Path, size: int) -> tuple[int, float, str]:
    """(budget, fraction, note): --budget-fraction of `size`, or the least whole percent above it at which
    every policy's plan places groups with at least one off the device."""
    def why_not(fraction: float) -> str | None:
        """None where every policy places groups at this fraction, else the planner's reason."""
        try:
            plans = _plans(ns, model, int(fraction * size))
        except ValueError as e:  # the planner's PlanError: not even whole blocks fit
            return str(e).split(";")[0]
        if all(p.group_placement is not None and p.group_placement.off_device for p in plans.values()):
            return None
        return next((n for p in plans.values() for n in p.notes if "blocks stream whole" in n),
                    "the model fits: no group leaves the device")

    why = why_not(ns.budget_fraction)
    if why is None:
        return int(ns.budget_fraction * size), ns.budget_fraction, ""
    start = math.floor(100 * ns.budget_fraction) + 1
    for percent in range(start, start + 100):
        if why_not(percent / 100) is None:
            return (int(percent / 100 * size), percent / 100,
                    f"at {ns.budget_fraction:.0%} of the weights the planner places no groups ({why}); raised to "
                    f"{percent}%, the least whole percent at which every policy places them")
    raise ValueError(f"no budget from {ns.budget_fraction:.0%} to {start + 99}% of the weights places groups for "
                     f"every policy ({why})")


# -- the child: one policy's engine -------------------------------------------------------------------
def _prompt(n: int, salt: int = 0) -> list[int]:
    """Token ids of our own (the tokenizer may be a stand-in: bench-scale's checkpoint on a GPU image)."""
    return [(97 * i + 31 * salt + 5) % 8000 + 100 for i in range(n)]  # below every shape's vocabulary


def _snapshot(engine) -> dict:
    t = engine.telemetry()
    s = t.offload
    return dict(groups_cpu=s.groups_cpu, groups_stream=s.groups_stream, steps_cpu=s.steps_cpu,
                steps_stream=s.steps_stream, bytes_cpu=s.bytes_cpu, bytes_stream=s.bytes_stream,
                bytes_streamed=t.total.bytes_streamed, time=time.perf_counter())


def _phase(before: dict, after: dict, tokens: int, steps: int, mlp_bytes: float) -> dict:
    d = {k: after[k] - before[k] for k in before}
    d.update(seconds=d.pop("time"), tokens=tokens, steps=steps, cpu_read_bytes=d["groups_cpu"] * mlp_bytes)
    return d


def _run_to_first_tokens(engine, ids: set) -> tuple[int, int]:
    """Steps until every request in `ids` has its first token: (steps, tokens emitted)."""
    waiting, steps, tokens = set(ids), 0, 0
    while waiting:
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.new_token_ids:
                waiting.discard(out.request_id)
        steps += 1
    return steps, tokens


def _decode(engine, steps: int) -> int:
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens


def _finish(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def _child(ns) -> dict:
    import torch

    from engine import LLMEngine
    from engine.sampling_params import SamplingParams

    if ns.threads:
        torch.set_num_threads(ns.threads)
    t0 = time.perf_counter()
    engine = LLMEngine(engine_args(ns, Path(ns.model), ns.child, ns.budget))
    load_s = time.perf_counter() - t0
    try:
        placement = engine.plan.group_placement
        if placement is None or not placement.off_device:  # the parent planned groups at this budget
            raise RuntimeError(f"{ns.child}: this engine's plan places no groups off the device:\n"
                               f"{engine.plan.describe()}")
        off = placement.off_device_groups
        mlp_bytes = sum(g.nbytes for g in off) / len(off)  # every dense MLP has one shape
        links = engine.telemetry().links
        result = dict(policy=ns.child, load_s=load_s, off_device=len(off), mlp_bytes=mlp_bytes,
                      device_bytes=engine.plan.device_bytes, link_gbps=links.h2d_gbps, plan=engine.plan.describe())
        speeds = engine.measured_speeds()
        if ns.child == "auto" and speeds is not None:
            result["speeds"] = dict(speeds.__dict__)

        def params():
            return SamplingParams(max_tokens=max_tokens(ns), temperature=0, ignore_eos=True)

        engine.add_request(_prompt(16, salt=99), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), "warm")
        _finish(engine)
        phases = {}
        engine.add_request(_prompt(ns.prompt_tokens), params(), "prompt")
        before = _snapshot(engine)
        steps, _ = _run_to_first_tokens(engine, {"prompt"})
        phases["prefill"] = _phase(before, _snapshot(engine), ns.prompt_tokens, steps, mlp_bytes)
        _decode(engine, WARM_STEPS)
        before = _snapshot(engine)
        tokens = _decode(engine, ns.decode_tokens)
        phases["batch 1"] = _phase(before, _snapshot(engine), tokens, ns.decode_tokens, mlp_bytes)
        engine.abort("prompt")
        ids = {f"b{i}" for i in range(ns.batch)}
        for i in range(ns.batch):
            engine.add_request(_prompt(ns.batch_prompt_tokens, salt=i + 1), params(), f"b{i}")
        _run_to_first_tokens(engine, ids)
        _decode(engine, WARM_STEPS)
        before = _snapshot(engine)
        tokens = _decode(engine, ns.decode_tokens)
        phases["batch N"] = _phase(before, _snapshot(engine), tokens, ns.decode_tokens, mlp_bytes)
        for i in ids:
            engine.abort(i)
        result["phases"] = phases
        return result
    finally:
        engine.close()


def _run_child(ns, policy: str, model: Path, budget: int, ngl: int | None = None) -> dict:
    # this module, not the `layerstream` dispatcher: nothing imports the server's packages (a GPU image lacks them)
    argv = [sys.executable, "-m", "layerstream.bench.placement", "--child", policy,
            "--model", str(model), "--budget", str(budget), "--device", ns.device, "--shape", ns.shape,
            "--prompt-tokens", str(ns.prompt_tokens), "--batch", str(ns.batch),
            "--batch-prompt-tokens", str(ns.batch_prompt_tokens), "--decode-tokens", str(ns.decode_tokens)]
    if ns.threads:
        argv += ["--threads", str(ns.threads)]
    if ngl is not None:
        argv += ["--ngl", str(ngl)]
    t0 = time.perf_counter()
    try:
        # the kernels' own OpenMP threads too, not only torch's
        env = {**os.environ, **({"OMP_NUM_THREADS": str(ns.threads)} if ns.threads else {})}
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=ns.timeout, env=env)
    except subprocess.TimeoutExpired as e:
        return dict(policy=policy, error=f"no result in {ns.timeout:.0f} s", stderr_tail=str(e.stderr or "")[-1500:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return dict(policy=policy, error=f"exit {proc.returncode}", stderr_tail=proc.stderr[-1500:])
    return {**json.loads(lines[-1]), "wall_s": time.perf_counter() - t0}


# -- llama.cpp -ngl -----------------------------------------------------------------------------------
def llama_cpp_unavailable(gguf: Path | None) -> str | None:
    """Why llama.cpp's row cannot run here (None: it can)."""
    try:
        import llama_cpp
    except ImportError:
        return "llama-cpp-python is not installed"
    if not llama_cpp.llama_supports_gpu_offload():
        return f"llama-cpp-python {llama_cpp.__version__} was built without GPU offload"
    if gguf is None or not gguf.exists():
        return f"no GGUF of these weights ({gguf or '--gguf'}; bench-scale makes one with llama.cpp's converter)"
    return None


def _child_llama_cpp(ns) -> dict:
    """llama.cpp with -ngl layers on the GPU (the rest computed on the CPU): prefill and batch-1 decode."""
    from llama_cpp import Llama

    ids = _prompt(ns.prompt_tokens)
    llm = Llama(model_path=ns.model, n_gpu_layers=ns.ngl, n_batch=len(ids), verbose=False,
                n_ctx=len(ids) + max_tokens(ns),
                **({"n_threads": ns.threads, "n_threads_batch": ns.threads} if ns.threads else {}))
    times = []
    for _tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        times.append(time.perf_counter())
        if len(times) == ns.decode_tokens + WARM_STEPS + 1:
            break
    llm.close()
    return dict(phases={"batch 1": dict(tokens=ns.decode_tokens, seconds=times[-1] - times[-1 - ns.decode_tokens])})


def _ngl(plan, budget: int) -> int:
    """Layers llama.cpp's -ngl can put on the device in `budget`: whole blocks beside the KV pool and workspace
    our plan reserves (its head stays on the CPU unless every layer fits)."""
    return max(0, min(plan.num_layers, (budget - plan.kv_cache_bytes - plan.workspace_bytes) // plan.block_bytes))


# -- the report ---------------------------------------------------------------------------------------
def _rows(r: dict, mem_gbps: float) -> list[dict]:
    out = []
    for name in ROWS:
        p = r.get("phases", {}).get(name)
        if not p or not p["seconds"]:
            out.append(dict(row=name))
            continue
        tps = p["tokens"] / p["seconds"]
        link = p.get("bytes_stream", 0)
        cpu = p.get("cpu_read_bytes", 0)
        floor_s = (link / (r["link_gbps"] * 1e9) if r.get("link_gbps") else 0.0) + cpu / (mem_gbps * 1e9)
        floor = p["tokens"] / floor_s if floor_s else None
        out.append(dict(row=name, tps=tps, link_per_token=link / p["tokens"], cpu_per_token=cpu / p["tokens"],
                        floor=floor, pct=100 * tps / floor if floor else None, steps_cpu=p.get("steps_cpu"),
                        steps_stream=p.get("steps_stream"), steps=p["steps"]))
    return out


def verdicts(rows: dict[str, list[dict]], batch: int, llama_b1: float | None, why_not: str | None) -> list[str]:
    """One line per target: auto >= the better of stream and cpu in every row; auto >= 1.2x llama.cpp at batch 1."""
    lines = []
    if all(p in rows for p in POLICIES):
        for i, name in enumerate(ROWS):
            name = name.replace("batch N", f"batch {batch}")
            auto = rows["auto"][i].get("tps")
            best = max((rows[p][i].get("tps") or 0.0 for p in ("stream", "cpu")), default=0.0)
            if auto is None or not best:
                lines.append(f"auto >= best of stream, cpu at {name}: not measured")
            else:
                lines.append(f"auto >= best of stream, cpu at {name}: {'MET' if auto >= best else 'NOT MET'} "
                             f"({auto:.2f} vs {best:.2f} tok/s, {auto / best:.2f}x)")
    else:
        lines.append("auto >= best of stream, cpu: not measured (a policy left out or failed)")
    auto_b1 = rows.get("auto", [{}, {}])[1].get("tps")
    if llama_b1 and auto_b1:
        lines.append(f"auto >= 1.2x llama.cpp at batch 1: {'MET' if auto_b1 >= 1.2 * llama_b1 else 'NOT MET'} "
                     f"({auto_b1:.2f} vs {llama_b1:.2f} tok/s, {auto_b1 / llama_b1:.2f}x)")
    else:
        lines.append(f"auto >= 1.2x llama.cpp at batch 1: not measured ({why_not or 'no figure'})")
    return lines


def run(ns: argparse.Namespace) -> int:
    ns.policy_list = [p.strip() for p in ns.policies.split(",") if p.strip()]
    for p in ns.policy_list:
        if p not in POLICIES:
            raise ValueError(f"--policies: unknown policy {p!r}: choose from {', '.join(POLICIES)}")
    if ns.device not in ("cuda", "cpu"):
        raise ValueError(f"--device must be cuda or cpu, got {ns.device!r}")
    from engine.loader import PLACEMENT

    os.environ[PLACEMENT] = "groups"  # for this process's plans (choose_budget) and every child's engine
    if ns.child:
        print(json.dumps(_child_llama_cpp(ns) if ns.child == "llama.cpp" else _child(ns)))
        return 0
    import torch

    from .scale import build_checkpoint, memory_gbps

    if ns.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (--device cpu runs the simulated link)")
    root = model_root(ns.shape)
    t0 = time.perf_counter()
    model = build_checkpoint(root / "bf16", shape_config(ns.shape), draw_on=ns.device, any_tokenizer=True)
    build_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    budget, fraction, note = choose_budget(ns, model, size)
    mem_gbps = memory_gbps(ns.threads or torch.get_num_threads())
    gpu = torch.cuda.get_device_name() if ns.device == "cuda" else None
    print(f"{gpu + '; host: ' if gpu else ''}{machine_description()}; host memory read {mem_gbps:.1f} GB/s "
          f"(bench-scale's memory_gbps)")
    if ns.device == "cpu":
        print("SIMULATED: --device cpu, the simulated link (LAYERSTREAM_SIM_GBPS); the 'device' computes on this CPU, "
              "so these figures exercise the benchmark, they do not measure a GPU")
    print(f"model: shape {ns.shape}, {size / 2**30:.2f} GiB of bf16 weights in {model} (ready in {build_s:.0f} s)")
    if note:
        print(f"budget: {note}")
    print(f"device budget {budget / 2**30:.2f} GiB = {fraction:.0%} of the weights; prompt {ns.prompt_tokens} tokens, "
          f"{ns.decode_tokens} timed decode steps at batch 1 and at batch {ns.batch} "
          f"({ns.batch_prompt_tokens}-token prompts)\n", flush=True)

    results, rows = {}, {}
    for policy in ns.policy_list:
        r = results[policy] = _run_child(ns, policy, model, budget)
        if "error" in r:
            print(f"{policy}: FAILED ({r['error']}):\n{r['stderr_tail']}", flush=True)
            continue
        rows[policy] = _rows(r, mem_gbps)
        speeds = r.get("speeds")
        print(f"{policy}: {r['off_device']} MLPs of {r['mlp_bytes'] / 2**20:.0f} MiB off the device, "
              f"planned {r['device_bytes'] / 2**30:.2f} GiB, link {fmt(r['link_gbps'], 1)} GB/s, "
              f"load {r['load_s']:.0f} s"
              + (f"; auto's measured speeds: CPU {speeds['cpu_gbps']:.1f} GB/s at one row, "
                 f"{speeds['cpu_flops'] / 1e12:.2f} TFLOP/s at 64 rows, device {speeds['device_flops'] / 1e12:.1f} "
                 "TFLOP/s" if speeds else ""), flush=True)

    gguf = Path(ns.gguf) if ns.gguf else root / f"{ns.shape}.BF16.gguf"
    why_not = "no GPU (--device cpu)" if ns.device == "cpu" else llama_cpp_unavailable(gguf)
    llama_b1 = None
    if why_not is None:
        plan = _plans(ns, model, budget)[ns.policy_list[0]]
        ngl = _ngl(plan, budget)
        r = results["llama.cpp"] = _run_child(ns, "llama.cpp", gguf, budget, ngl)
        if "error" in r:
            why_not = f"its run failed: {r['error']}"
            print(f"llama.cpp: FAILED ({r['error']}):\n{r['stderr_tail']}", flush=True)
        else:
            p = r["phases"]["batch 1"]
            llama_b1 = p["tokens"] / p["seconds"]
            print(f"llama.cpp -ngl {ngl}: decode at batch 1 {llama_b1:.2f} tok/s", flush=True)
    if why_not:
        print(f"llama.cpp: not available ({why_not})")

    header = ["policy", "row", "tok/s", "link MB/token", "CPU-read MB/token", "floor tok/s", "% of floor",
              "cpu / stream steps"]
    lines = []
    for policy, rs in rows.items():
        for x in rs:
            label = x["row"].replace("batch N", f"batch {ns.batch}")
            if "tps" not in x:
                lines.append([policy, label] + ["-"] * 6)
                continue
            lines.append([policy, label, fmt(x["tps"]), fmt(x["link_per_token"] / 1e6, 1),
                          fmt(x["cpu_per_token"] / 1e6, 1), fmt(x["floor"]), fmt(x["pct"], 0),
                          f"{x['steps_cpu']} / {x['steps_stream']} of {x['steps']}"])
    print()
    print(table(header, lines))
    print("\nfloor = tokens / (link bytes / link GB/s + CPU-read bytes / host memory GB/s)")
    checks = verdicts(rows, ns.batch, llama_b1, why_not)
    for line in checks:
        print(("SIMULATED " if ns.device == "cpu" else "") + "verdict: " + line)
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps({"machine": machine_description(), "gpu": gpu,
                                             "simulated": ns.device == "cpu",
                                             "shape": ns.shape, "budget": budget, "budget_fraction": fraction,
                                             "budget_note": note, "memory_gbps": mem_gbps, "results": results,
                                             "rows": rows, "llama_cpp_b1": llama_b1, "llama_cpp_why_not": why_not,
                                             "verdicts": checks}, indent=1))
    if ns.png and rows:
        simulated = " (simulated)" if ns.device == "cpu" else ""
        c = Chart(f"bench-placement {ns.shape} at {fraction:.0%} of the weights{simulated}")
        for i, name in enumerate(ROWS):
            c.add(f"{name.replace('batch N', f'batch {ns.batch}')} tok/s", list(rows),
                  [rows[p][i].get("tps") for p in rows], [POLICIES.index(p) + 1 for p in rows])
        c.save(ns.png)
    return 1 if any("error" in r for p, r in results.items() if p != "llama.cpp") else 0


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m layerstream.bench.placement", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
