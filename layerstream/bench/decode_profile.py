"""Where a single-stream decode step's time goes on the CPU, by the decoding thread's CPU time, one thread
(or by wall time with --threads above 1, where the other threads' work counts too):
the whole `engine.step()` (median decode step of a 33-token greedy run), and the model's blocks, the matmuls
inside them (and a plain read of their weights' bytes, the best a kernel reading them could do), their decode
attention (and the speed of its KV read) and the LM head each timed alone (one
decode row at --position: a short context by default), in one process, medians of --rounds. The whole step is also timed with the blocks op by op (the C++ decode block off) and op by op with
SDPA (the fused decode attention off too), alternating with the default: an A/B on the same weights even on a
shared machine.

Default model: the Q4_0 GGUF that bench-packed makes (run it once first).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .common import BENCH_ROOT

PROMPT = "What is the capital of France? Answer in one long paragraph about its history."
POSITION = 40  # the decode row's default position: a short context, as in bench-packed's 32-token decodes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(BENCH_ROOT / "smollm2" / "SmolLM2-135M-Instruct.Q4_0.gguf"))
    p.add_argument("--rounds", type=int, default=5, help="rounds of every measurement; medians reported")
    p.add_argument("--calls", type=int, default=20, help="calls per round of each timed part")
    p.add_argument("--position", type=int, default=POSITION,
                   help="the timed parts' decode row attends to this many earlier keys (random values, written "
                        "first); the whole step decodes a short prompt whatever it is")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; above 1 the parts are timed by wall time, not the thread's CPU time")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def run(ns: argparse.Namespace) -> int:
    import torch

    from engine import LLM, SamplingParams
    from engine import model as M
    from engine import ops
    from engine.kernels.fused_ops import fused_ops
    from engine.weights.probes import file_mappings, tensor_parts

    if not Path(ns.model).exists():
        sys.exit(f"{ns.model} not found (bench-packed makes it)")
    torch.set_num_threads(ns.threads)
    clock = time.thread_time if ns.threads == 1 else time.perf_counter
    position = ns.position
    llm = LLM(ns.model, max_model_len=max(512, position + 64), max_num_seqs=1)
    try:
        engine, runner = llm.engine, llm.engine.model.runner
        cfg, weights = runner.cfg, runner.weights
        weights.wait_resident_copies(300)  # steady state: resident copies collapsed into huge pages (if any)
        blocks = []
        for i in range(cfg.num_layers):
            blocks.append(weights.acquire(i))
            weights.release(i)  # resident blocks stay valid; a streamed one would not (say so below)
        if cfg.num_layers > len(engine.plan.resident_blocks):
            print("note: some blocks are streamed; the parts time their last prepared copies")
        bs = runner.kv.block_size
        pos = torch.tensor([position])
        tables = torch.arange(position // bs + 1)[None]  # (1, blocks)
        for i in range(cfg.num_layers):
            # Cached keys and values the row attends to, written as a prompt's would be: pages of the pool
            # never written all map the kernel's one zero page, which would make their reads free.
            for cache in runner.kv.layer(i):
                cache[: tables.shape[1]].normal_(std=0.5)
        slots = tables.gather(1, (pos // bs)[:, None])[:, 0] * bs + pos % bs
        cos, sin = M.rotary_cos_sin(pos, runner.inv_freq, runner.rope_scaling, runner.dtype)
        keys = torch.arange(position + 1)
        step = M.StepInputs(input_ids=torch.zeros(1, dtype=torch.long), positions=pos, cos=cos, sin=sin,
                            slot_mapping=slots, block_tables=tables, pad_rows=None, max_query=1,
                            context_len=position + 1, attn_mask=(keys[None, :] <= pos[:, None])[:, None, None, :],
                            logits_index=torch.arange(1))
        x0 = torch.randn(1, cfg.hidden_size).to(runner.dtype)  # (1, hidden)

        def whole_step() -> float:
            engine.add_request(PROMPT, SamplingParams(max_tokens=33, temperature=0, ignore_eos=True), str(time.time()))
            steps = []
            while engine.has_unfinished():
                t = clock()
                engine.step()
                steps.append(clock() - t)
            return _median(steps[1:])  # decode steps only

        def blocks_once():
            x = x0
            with ops.single_row_products(x0):  # as runner.execute runs them
                for i, w in enumerate(blocks):
                    k_cache, v_cache = runner.kv.layer(i)
                    x = M.block_forward(x, w, k_cache, v_cache, step, cfg)

        # stacked where the block's tensors share a type, apart where they do not (Q4_K_M's Q6_K v and down
        # projections in some layers)
        names = ("wqkv", "wq", "wk", "wv", "wo", "w_gate_up", "w_gate", "w_up", "w_down")
        block_weights = [w[name] for w in blocks for name in names if name in w]
        # each product's row as wide as its weight's inputs: the hidden size, heads x head_dim for the o
        # projection (Gemma 3's differs from its hidden size), the intermediate size for down
        rows = {w.shape[1]: torch.randn(1, w.shape[1]).to(runner.dtype) for w in block_weights}  # in -> (1, in)
        products = [(w, rows[w.shape[1]]) for w in block_weights]

        def matmuls_once():
            with ops.single_row_products(x0):
                for w, x in products:
                    ops.linear(x, w)

        # The same weights' bytes read in the same order with nothing computed, the way the kernels stream
        # them (fused_ops' stream_read): what the matmuls could at best reach on this machine at this moment.
        weight_tensors = [t.contiguous() for w, _ in products for t in tensor_parts(w).values()]

        def read_once():
            fused_ops().stream_read(weight_tensors)

        q1 = torch.randn(1, cfg.num_heads, cfg.head_dim).to(runner.dtype)  # (1, heads, head_dim)
        kv1 = torch.randn(1, cfg.num_kv_heads, cfg.head_dim).to(runner.dtype)  # (1, kv_heads, head_dim)
        k0 = runner.kv.layer(0)[0]  # (blocks, block_size, kv_heads, head_dim) when the fused kernel reads it
        plain = isinstance(k0, torch.Tensor) and tuple(k0.shape[2:]) == (cfg.num_kv_heads, cfg.head_dim)
        attention_tables = ops.token_by_token(step, q1, kv1, kv1, k0) if plain else None

        def attention_once():  # the fused decode attention of every layer, as block_forward calls it
            for i in range(cfg.num_layers):
                k_cache, v_cache = runner.kv.layer(i)
                ops.decode_attention(q1, kv1, kv1, k_cache, v_cache, step, attention_tables)

        def head_once():
            with ops.single_row_products(x0):
                ops.linear(x0, runner.globals.head)

        real_block, real_attention = ops.decode_block, ops.token_by_token
        modes = {"whole step (engine.step)": (real_block, real_attention),
                 "whole step, blocks op by op": (lambda: None, real_attention),
                 "whole step, op by op, SDPA attention": (lambda: None, lambda *a: None)}
        parts = {"blocks (default path)": blocks_once, "  of which their matmuls alone": matmuls_once,
                 "  a plain read of their weights": read_once,
                 "  of which their decode attention alone": attention_once, "LM head": head_once}
        if fused_ops() is None:
            del parts["  a plain read of their weights"]
        if attention_tables is None:  # not the fused kernel's step (fp32, quantized or latent KV)
            del parts["  of which their decode attention alone"]
        read = {"  of which their matmuls alone": sum(w.nbytes for w, _ in products),
                "  a plain read of their weights": sum(t.nbytes for t in weight_tensors),
                "LM head": runner.globals.head.nbytes}  # weight bytes each part reads (tensors and packed weights alike)
        kv_bytes = 2 * (position + 1) * cfg.num_kv_heads * cfg.head_dim * runner.dtype.itemsize * cfg.num_layers
        times: dict[str, list[float]] = {k: [] for k in (*modes, *parts)}
        whole_step()  # warm
        for _ in range(ns.rounds):
            for name, (block, attention) in modes.items():
                ops.decode_block, ops.token_by_token = block, attention
                try:
                    times[name].append(whole_step())
                finally:
                    ops.decode_block, ops.token_by_token = real_block, real_attention
            for name, fn in parts.items():
                t = clock()
                for _ in range(ns.calls):
                    fn()
                times[name].append((clock() - t) / ns.calls)
        mapped = {p: v for p, v in file_mappings().items() if v[0] >= 64 << 20}  # the weights' files
        copies = engine.telemetry()
        anon = _anonymous_memory()
    finally:
        llm.close()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"{Path(ns.model).name}: one decode row at position {position}, {ns.threads} thread(s), "
          f"{'thread CPU' if ns.threads == 1 else 'wall'} time, medians of "
          f"{ns.rounds}; load average {load}")
    for name, xs in times.items():
        speed = (f"  {kv_bytes / _median(xs) / 1e9:.1f} GB/s of KV read" if name.endswith("attention alone") else
                 f"  {read[name] / _median(xs) / 1e9:.1f} GB/s of weights" if name in read else "")
        print(f"{name:<40} {_median(xs) * 1e3:8.2f} ms{speed}")
    for path, (rss, huge) in mapped.items():  # 4 KiB pages stream slower (engine/weights/formats/views.py)
        print(f"mapped {Path(path).name}: {rss / 2**20:.0f} MiB, {huge / max(rss, 1):.0%} of it in huge pages")
    if copies.resident_copies:
        print(f"resident copies: {copies.resident_copies}, blocks and head ({copies.resident_copies_in_huge_pages} "
              f"collapsed into huge pages); the process's anonymous memory {anon[0] / 2**20:.0f} MiB, "
              f"{anon[1] / max(anon[0], 1):.0%} of it in huge pages")
    return 0


def _anonymous_memory() -> tuple[int, int]:
    """(anonymous bytes, of which in huge pages) of this process (/proc/self/smaps_rollup; zeros elsewhere)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    except OSError:
        return 0, 0
    return tuple(int(fields.get(k, "0 kB").split()[0]) << 10 for k in ("Anonymous", "AnonHugePages"))


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main("bench-decode-profile", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
