"""`python -m layerstream.bench.amx`: the CPU choices that turn on AMX (engine.ops.onednn_has_amx), each A/B'd in
one process on the same weights, alternating, so that this VM's drifting memory bandwidth hits both sides:

1. step: a one-sequence decode step's median time with one bf16 row on oneDNN (the AMX choice) and on
   torch's matrix-vector kernel (the choice without AMX), for the benchmark model streamed at 25% of its
   fp32 weights and all resident, and a SmolLM2-shaped bf16 model (576 wide, random weights) resident and
   streamed; for the streamed benchmark model also how much of a step its dense products take.
2. attention: one bf16 prompt chunk's attention (128 tokens after 1872 and after 872 cached keys, 16
   heads of 64 over 4 KV heads), SDPA's flash kernel (the AMX choice) against the bf16 matmul path (the
   choice without AMX): time, and the largest and mean error against float64.

The 2-16-row products are `layerstream bench-bf16-rows`; the served effect is `layerstream bench-paged`.

    python -m layerstream.bench.amx                  # both parts
    python -m layerstream.bench.amx --parts attention
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from .common import bench_model_path, cached_random_model, machine_description
from .offline import weight_bytes

PROMPT = [(i * 7) % 500 + 6 for i in range(16)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", default="step,attention")
    p.add_argument("--rounds", type=int, default=6, help="alternations of the two choices")
    p.add_argument("--steps", type=int, default=15, help="step: decode steps timed per choice and round (median)")
    p.add_argument("--calls", type=int, default=15, help="attention: calls per choice (min and median)")


def smollm2_shape_path() -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, rms_norm_eps=1e-5,
                      rope_theta=100000.0, tie_word_embeddings=True, architectures=["LlamaForCausalLM"])
    return cached_random_model("smollm2-135m-shape-bf16", cfg, tokenizer_vocab=512)


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1000


def step_ab(folder: Path, budget: int | None, ns: argparse.Namespace, products: bool,
            max_model_len: int = 1024) -> str:
    """One line: the two choices' median step times per round, and the products' share (products=True)."""
    from engine import ops
    from engine.args import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=str(folder), max_device_memory=budget, max_model_len=max_model_len,
                                  max_num_seqs=4, max_num_batched_tokens=128, show_progress=False))
    real_choice, real_linear = ops.onednn_has_amx, ops.linear
    spent = [0.0]

    def timed_linear(x, w, bias=None):
        t0 = time.perf_counter()
        try:
            return real_linear(x, w, bias)
        finally:
            spent[0] += time.perf_counter() - t0

    try:
        streamed = len(engine.plan.streamed_blocks)
        params = SamplingParams(max_tokens=max_model_len - len(PROMPT), temperature=0.0, ignore_eos=True)
        engine.add_request(PROMPT, params)
        for _ in range(4):  # the prompt and the first decode steps
            engine.step()
        medians: dict[bool, list[float]] = {True: [], False: []}
        share: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(ns.rounds):
            for amx in (True, False):
                ops.onednn_has_amx = lambda amx=amx: amx
                ops.linear = timed_linear if products else real_linear
                times = []
                for _ in range(ns.steps):
                    spent[0] = 0.0
                    t0 = time.perf_counter()
                    engine.step()
                    times.append(time.perf_counter() - t0)
                    share[amx].append(spent[0] / times[-1])
                medians[amx].append(_median_ms(times))
    finally:
        ops.onednn_has_amx, ops.linear = real_choice, real_linear
        engine.close()
    line = (f"{streamed} of {engine.plan.num_layers} blocks streamed; median step per round, ms: oneDNN "
            f"{' '.join(f'{t:.1f}' for t in medians[True])} (median {statistics.median(medians[True]):.1f}) | "
            f"torch's kernel {' '.join(f'{t:.1f}' for t in medians[False])} "
            f"(median {statistics.median(medians[False]):.1f})")
    if products:
        line += (f"; dense products (ops.linear) {statistics.median(share[True]):.0%} of a step on oneDNN, "
                 f"{statistics.median(share[False]):.0%} on torch's kernel")
    return line


def _problem(rows: int, ctx: int):
    import torch

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, rows, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 4, ctx, 64, generator=g).bfloat16() for _ in range(2))
    start = ctx - rows
    pos = torch.arange(ctx)
    mask = (pos[None, :] <= start + torch.arange(rows)[:, None])[None, None]  # (1, 1, rows, ctx) causal
    return q, k, v, mask, start


def _reference(q, k, v, mask):
    import torch

    group = q.shape[1] // k.shape[1]
    kk, vv = (t.double().repeat_interleave(group, 1) for t in (k, v))
    s = (q.double() @ kk.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv


def attention_ab(ns: argparse.Namespace) -> list[str]:
    from engine import ops

    lines, real = [], ops.bf16_matmul_attention
    try:
        for rows, ctx in ((128, 2000), (128, 1000)):
            q, k, v, mask, start = _problem(rows, ctx)
            want = _reference(q, k, v, mask)
            cells = []
            for name, matmul in (("flash", False), ("matmul path", True)):
                ops.bf16_matmul_attention = lambda matmul=matmul: matmul
                out = ops.attend(q, k, v, mask, None, start, None)
                err = (out.double() - want).abs()
                times = []
                for _ in range(ns.calls):
                    t0 = time.perf_counter()
                    ops.attend(q, k, v, mask, None, start, None)
                    times.append(time.perf_counter() - t0)
                cells.append(f"{name} min {min(times) * 1000:.2f} ms, median {_median_ms(times):.2f}, "
                             f"error max {err.max():.2e} mean {err.mean():.2e}")
            lines.append(f"{rows} tokens over {ctx} keys: " + " | ".join(cells))
    finally:
        ops.bf16_matmul_attention = real
    return lines


def run(ns: argparse.Namespace) -> int:
    import torch

    from engine.kernels import onednn_has_amx

    parts = {p.strip() for p in ns.parts.split(",") if p.strip()}
    print(f"machine: {machine_description()}; torch threads {torch.get_num_threads()}; "
          f"oneDNN has AMX: {onednn_has_amx()}", flush=True)
    if "step" in parts:
        bench = bench_model_path()
        quarter = int(0.25 * weight_bytes(bench, "float32")[0])
        smol = smollm2_shape_path()
        for name, folder, budget, products in (("benchmark model, 25% of its fp32 weights", bench, quarter, True),
                                               ("benchmark model, all resident", bench, None, False),
                                               ("SmolLM2 shape, all resident", smol, None, False),
                                               ("SmolLM2 shape, 170 MB budget", smol, 170_000_000, False)):
            print(f"step, {name}: {step_ab(folder, budget, ns, products)}", flush=True)
    if "attention" in parts:
        for line in attention_ab(ns):
            print(f"attention, {line}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main("python -m layerstream.bench.amx", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
