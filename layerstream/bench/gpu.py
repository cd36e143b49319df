"""GPU benchmark: host->device bandwidth, then decode of one model under one device budget,
layerstream streaming (staging from the mmap, and with --pin-host-memory) vs transformers +
accelerate offload (device_map="auto" with max_memory), with layerstream all-resident as the
compute reference.

For each streaming peer it prints bytes streamed per token, decode time per token, and the
bandwidth limit (bytes per token / measured host->device GB/s) as an efficiency %.

    python -m layerstream.bench.gpu [--model FOLDER] [--resident-fraction 0.25] [--json out.json] [--png out.png]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

from layerstream.bench.common import Chart, bench_main, bench_model_path, fmt, machine_description, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model folder (default: the shared benchmark checkpoint)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--resident-fraction", type=float, default=0.25,
                   help="share of the blocks the device budget keeps resident; the rest stream")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-host-memory", default=None,
                   help="host memory the pinned row may pin (default: what its pinned cache needs plus the "
                        "transport's 2 GiB margin and 1 GiB, stated rather than read from MemAvailable)")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--png", default=None, help="also plot the results to this file")


def _prompt(n: int) -> list[int]:
    return [(17 * i + 5) % 500 + 1 for i in range(n)]


def _tpot(times: list[float]) -> float | None:
    """Median seconds between consecutive output tokens (decode only: the prefill token is first)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def pinned_host_budget(ns, plan) -> int:
    """The pinned row's explicit host budget: --max-host-memory, or its pinned cache plus the
    transport's margin and 1 GiB. MemAvailable on a fresh VM may start small and would otherwise
    decide, silently, that the row runs from staging."""
    from engine.planner import parse_bytes
    from engine.weights.probes import PINNED_HOST_MARGIN as HOST_MARGIN

    given = parse_bytes(getattr(ns, "max_host_memory", None))
    return given if given is not None else len(plan.streamed_blocks) * plan.block_bytes + HOST_MARGIN + (1 << 30)


def _layerstream(ns, folder: Path, budget: int | None, pin: bool, host_memory: int | None = None,
                 transport: str = "auto") -> dict:
    from engine import EngineArgs, LLMEngine
    from engine.sampling_params import SamplingParams

    ids = _prompt(ns.prompt_tokens)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineArgs(model=str(folder), device=ns.device, dtype=ns.dtype, max_device_memory=budget,
                                  max_host_memory=host_memory, max_model_len=ns.prompt_tokens + ns.max_tokens + 16,
                                  max_num_seqs=1, pin_host_memory=pin, transport=transport, show_progress=False))
    load_s = time.perf_counter() - t0
    try:
        plan = engine.plan
        pinned = engine.telemetry().pinned_cache
        if pin and plan.streamed_blocks and not pinned:
            print(f"--pin-host-memory FELL BACK to staging: the pinned cache did not fit the host budget "
                  f"({(host_memory or 0) / 2**30:.2f} GiB; see the transport's warning above)", flush=True)

        def generate(n: int) -> tuple[list[float], list[float]]:
            engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            times, stalls = [], []
            while engine.has_unfinished():
                for out in engine.step():
                    times += [time.perf_counter()] * len(out.new_token_ids)
                stalls.append(engine.telemetry().last_step.stream.stall_seconds)
            return times, stalls

        generate(4)  # warm-up: kernel selection, first-touch of pages
        times, stalls = generate(ns.max_tokens)
        return {"load_s": load_s, "resident_blocks": len(plan.resident_blocks),
                "streamed_blocks": len(plan.streamed_blocks), "bytes_per_token": plan.streamed_bytes_per_step,
                "device_budget": budget, "planned_device_bytes": plan.device_bytes,
                "host_pinned_bytes": engine.telemetry().pinned_host_bytes, "pinned_cache": pinned,
                "fell_back_to_staging": pin and bool(plan.streamed_blocks) and not pinned,
                "host_memory_budget": host_memory, "tpot_s": _tpot(times),
                "stall_ms_per_step": 1e3 * statistics.median(stalls[1:] or stalls)}
    finally:
        engine.close()
        del engine
        _release_device_memory()


def device_budget(ns, folder: Path):
    """(budget, plan, blocks kept): a device budget that keeps ns.resident_fraction of the blocks
    resident with this run's KV cache and stream buffers, from the plan's own figures."""
    from engine import EngineArgs, LLMEngine

    probe = LLMEngine(EngineArgs(model=str(folder), dtype=ns.dtype, max_num_seqs=1,
                                 max_model_len=ns.prompt_tokens + ns.max_tokens + 16, show_progress=False))
    p = probe.plan
    probe.close()
    keep = int(ns.resident_fraction * p.num_layers)
    return p.budget_keeping(keep), p, keep


def _release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _transformers_offload(ns, folder: Path, budget: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from engine.args import DTYPE_NAMES
    from engine.weights.probes import open_checkpoint

    class Clock(BaseStreamer):
        def __init__(self):
            self.times: list[float] = []
            self.calls = 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:  # the first call carries the prompt
                self.times.append(time.perf_counter())

        def end(self):
            pass

    t0 = time.perf_counter()
    # accelerate places whole blocks on the GPU until max_memory is used and offloads the rest to
    # the CPU, moving them to the GPU in every forward pass (AlignDevicesHook).
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPE_NAMES[ns.dtype], device_map="auto",
                                                 max_memory={0: budget, "cpu": "512GiB"}).eval()
    load_s = time.perf_counter() - t0
    dmap = getattr(model, "hf_device_map", {})
    reader = open_checkpoint(folder)
    try:
        offloaded = sum(reader.tensor(name).nbytes for name in reader.names()
                        if any(dev in ("cpu", "disk") and (name == m or name.startswith(m + "."))
                               for m, dev in dmap.items()))
    finally:
        reader.close()
    inp = torch.tensor([_prompt(ns.prompt_tokens)], device="cuda")

    def generate(n: int) -> list[float]:
        clock = Clock()
        with torch.inference_mode():
            model.generate(inp, attention_mask=torch.ones_like(inp), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, streamer=clock, pad_token_id=0)
        return [time.perf_counter()] if not clock.times else clock.times

    generate(4)
    times = generate(ns.max_tokens)
    on_gpu = sum(1 for dev in dmap.values() if dev not in ("cpu", "disk"))
    result = {"load_s": load_s, "bytes_per_token": offloaded, "tpot_s": _tpot(times), "device_budget": budget,
              "device_map_entries_on_gpu": on_gpu, "device_map_entries_offloaded": len(dmap) - on_gpu}
    del model
    torch.cuda.empty_cache()
    return result


def run(ns: argparse.Namespace) -> int:
    import torch

    from engine.weights import probes

    # The transport logs its measured bandwidth and the expected time per step at start-up.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        print("layerstream.bench.gpu: no CUDA device", file=sys.stderr)
        return 1
    folder = Path(ns.model) if ns.model else bench_model_path()
    gpu = torch.cuda.get_device_name()
    h2d = probes.host_to_device_gbps(ns.device)
    print(f"{gpu}; host: {machine_description()}")
    print(f"model: {folder}")
    print(f"host->device (pinned, 256 MiB copies): {h2d:.1f} GB/s")

    budget, p, keep = device_budget(ns, folder)
    print(f"{p.num_layers} blocks of {p.block_bytes / 2**20:.1f} MiB; device budget {budget / 2**30:.2f} GiB "
          f"keeps {keep} resident")

    peers = [("resident", lambda: _layerstream(ns, folder, None, False)),
             ("streaming", lambda: _layerstream(ns, folder, budget, False)),
             ("streaming --pin-host-memory", lambda: _layerstream(ns, folder, budget, True, pinned_host_budget(ns, p)))]
    if not ns.skip_transformers:
        peers.append(("transformers+accelerate offload", lambda: _transformers_offload(ns, folder, budget)))
    header = ["peer", "device budget GiB", "MiB streamed/token", "decode ms/token", "bandwidth limit ms/token",
              "achieved GB/s", "% of limit", "stall ms/step"]
    results, rows, failed = {}, [], []
    for name, measure in peers:
        try:
            r = results[name] = measure()
        except Exception as e:  # noqa: BLE001 - report a peer's failure, keep the others' figures
            print(f"{name} failed: {type(e).__name__}: {e}", file=sys.stderr)
            failed.append(name)
            continue
        if r.get("fell_back_to_staging"):
            name = f"{name} (FELL BACK to staging)"
        nbytes, tpot = r["bytes_per_token"], r["tpot_s"]
        floor = nbytes / (h2d * 1e9) if nbytes else None
        achieved, pct = probes.efficiency(nbytes, tpot, h2d) if nbytes and tpot else (None, None)
        r.update(h2d_gbps=h2d, floor_s=floor, achieved_gbps=achieved, pct_of_floor=pct)
        rows.append([name, fmt((r.get("device_budget") or 0) / 2**30), f"{nbytes / 2**20:.1f}",
                     fmt(tpot * 1e3 if tpot else None), fmt(floor * 1e3 if floor else None),
                     fmt(achieved, 1), fmt(pct, 0), fmt(r.get("stall_ms_per_step"))])
        # Each peer's figures as soon as they exist: a run cut short by the check's time limit keeps them.
        print(" | ".join(f"{h}: {v}" for h, v in zip(header, rows[-1])), flush=True)
    print()
    print(table(header, rows))
    print(f"\nbandwidth limit = bytes streamed per token / {h2d:.1f} GB/s (measured host->device); "
          "% of limit = limit / decode time per token")
    if ns.json:
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.json).write_text(json.dumps({"gpu": gpu, "model": str(folder), "h2d_gbps": h2d,
                                             "results": results, "failed": failed}, indent=2))
    if ns.png and results:
        chart(results, gpu, folder.name).save(ns.png)
    # The peer's failure is its own; any of ours fails the check.
    return 1 if [f for f in failed if not f.startswith("transformers")] else 0


def chart(results: dict[str, dict], gpu: str, model_name: str) -> Chart:
    """Decode time per token against its bandwidth limit, and the link speed each peer achieved."""
    names = list(results)
    groups = [0 if name.startswith("transformers") else 1 for name in names]
    c = Chart(f"{model_name} on {gpu}, same device budget (grey: transformers + accelerate, blue: layerstream)")
    c.add("decode ms/token", names, [1e3 * r["tpot_s"] if r["tpot_s"] else None for r in results.values()], groups)
    c.add("bandwidth limit ms/token", names,
          [1e3 * r["floor_s"] if r.get("floor_s") else None for r in results.values()], groups)
    c.add("achieved host->device GB/s", names, [r.get("achieved_gbps") for r in results.values()], groups)
    return c


def main(argv: list[str] | None = None) -> int:
    return bench_main("python -m layerstream.bench.gpu", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
