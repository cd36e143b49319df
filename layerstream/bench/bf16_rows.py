"""bf16 products of a few rows on the CPU: oneDNN's kernel (torch's default) against torch's own, which
engine.ops.single_row_products chooses for a step of one row where bf16_rows.cpp is not in use, and against
engine/kernels/bf16_rows.cpp, which engine.ops.linear chooses for 1-16 rows on AVX512-BF16 CPUs without AMX
("-" where it does not apply). Each shape is cycled
through enough distinct weights that every call reads its weight from memory, as a decode step does;
best of --rounds rounds, microseconds per product, 1 and 2 threads.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# SmolLM2-135M's (q/k/v/o, gate and up, down, head), the benchmark model's (stacked qkv, stacked gate_up, down)
# and bench-scale's 3B model's (q/o, gate/up, down)
SHAPES = ((576, 576), (1536, 576), (576, 1536), (49152, 576), (1536, 1024), (5632, 1024), (1024, 2816),
          (3072, 3072), (8192, 3072), (3072, 8192))
CYCLE_BYTES = 200 << 20  # well past the last-level cache


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", default="1,2,4,8,16", help="rows of x (comma separated)")
    p.add_argument("--threads", default="1,2", help="torch thread counts (comma separated)")
    p.add_argument("--rounds", type=int, default=3)


def run(ns: argparse.Namespace) -> int:
    import torch
    import torch.nn.functional as F

    from engine.kernels.bf16_rows import bf16_rows

    rows_kernel = bf16_rows()  # measured even where the engine leaves 2-16 rows to oneDNN (AMX)

    def best_us(ws: list, x: torch.Tensor, onednn: bool, product=F.linear) -> float:
        torch._C._set_mkldnn_enabled(onednn)
        try:
            for w in ws[:3]:
                product(x, w)
            best = float("inf")
            for _ in range(ns.rounds):
                t = time.perf_counter()
                for w in ws:
                    product(x, w)
                best = min(best, (time.perf_counter() - t) / len(ws))
            return best * 1e6
        finally:
            torch._C._set_mkldnn_enabled(True)

    def ours(ws: list, x: torch.Tensor) -> str:
        if rows_kernel is None or not rows_kernel.applies(x, ws[0]):
            return "-"
        return f"{best_us(ws, x, True, rows_kernel.linear):.0f}"

    rows = [int(r) for r in ns.rows.split(",")]
    print(f"bf16 F.linear, weights read from memory, best of {ns.rounds}, µs per product (oneDNN / torch's kernel / "
          f"bf16_rows.cpp); "
          f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    g = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        count = max(3, CYCLE_BYTES // (shape[0] * shape[1] * 2))
        ws = [torch.randn(*shape, generator=g).bfloat16() for _ in range(count)]
        for threads in (int(t) for t in ns.threads.split(",")):
            torch.set_num_threads(threads)
            cells = []
            for m in rows:
                x = torch.randn(m, shape[1], generator=g).bfloat16()
                cells.append(f"M={m} {best_us(ws, x, True):.0f} / {best_us(ws, x, False):.0f} / {ours(ws, x)}")
            print(f"{shape[0]}x{shape[1]}, {threads} thread(s): " + "  ".join(cells), flush=True)
        del ws
    return 0


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main("python -m layerstream.bench.bf16_rows", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
