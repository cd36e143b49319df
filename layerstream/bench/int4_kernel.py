"""One weight-only matmul y = x @ W.T, kernel against kernel, side by side in one run (one thread):

  vnni       our AVX512-VNNI int4 kernel (engine/kernels/int4_vnni.cpp): x quantized to int8 per 32
             on the fly, 4-bit codes with a float16 (scale, min) per 32, integer dot products
  aten-int4  torch's _weight_int4pack_mm_for_cpu (group 32, bf16 scale/zero): what ran before
  int8       torch's _weight_int8pack_mm (per-row scale)
  vnni-int8  the same kernel's int8-weight twin (per-row scale, the same int8 activations)
  bf16       F.linear on a bf16 weight

Shapes default to SmolLM2-135M's: q/o 576x576, gate/up 1536x576, down 576x1536, the head
49152x576; x is bf16 with M rows (1 = decode, 5 = a speculative verify pass, 64 = prefill chunk).
"cold" (the default) cycles through enough copies of each weight to overflow the CPU's caches, as a
decode step that reads every block's weights once does; --hot reuses one copy (cache-resident).
Each peer is timed in turn, round after round, and the best round is kept, so all peers see the same
machine load. Prints microseconds per matmul and each peer's time over the vnni kernel's.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from engine import ops

SHAPES = "576x576,1536x576,576x1536,49152x576"
PEERS = ("vnni", "aten-int4", "int8", "vnni-int8", "bf16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=SHAPES, help="comma-separated OUTxIN weight shapes")
    p.add_argument("--m", default="1,5", help="comma-separated row counts of x")
    p.add_argument("--rounds", type=int, default=5, help="rounds per peer; the best is reported")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per peer per round (at least)")
    p.add_argument("--cold-bytes", type=float, default=96.0, help="MiB of weight copies cycled per peer (cold)")
    p.add_argument("--hot", action="store_true", help="reuse one weight copy (cache-resident)")
    p.add_argument("--threads", type=int, default=1)


def _weights(out: int, inner: int, copies: int, seed: int) -> dict[str, list]:
    """Each peer's packed form of the same random weight, `copies` times (distinct memory)."""
    from engine.kernels import int4_backend
    from engine.weights import Int4Weight, Int8Weight
    from engine.weights.probes import quantize_int4

    w = torch.randn(out, inner, generator=torch.Generator().manual_seed(seed)) * 0.05
    vnni = quantize_int4(w, torch.bfloat16)
    assert vnni.layout == int4_backend() == "vnni", "the VNNI kernel is not available here"
    g = w.reshape(out, -1, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).reshape(out, inner).to(torch.int32)
    aten_codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    aten_sz = torch.stack([scale, lo + 8 * scale], -1).transpose(0, 1).to(torch.bfloat16).contiguous()
    int8 = Int8Weight.quantize(w, torch.bfloat16)  # the vnni layout here
    i8_scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-30)
    i8_codes = torch.round(w / i8_scales[:, None]).clamp(-127, 127).to(torch.int8)
    bf16 = w.to(torch.bfloat16)
    peers = {
        "vnni": lambda: Int4Weight(vnni.codes.clone(), vnni.scales.clone(), vnni.shape, "vnni"),
        "aten-int4": lambda: (aten_codes.clone(), aten_sz.clone()),
        "int8": lambda: Int8Weight(i8_codes.clone(), i8_scales.to(torch.bfloat16)),
        "vnni-int8": lambda: int8.clone(),
        "bf16": lambda: bf16.clone(),
    }
    sizes = {"vnni": vnni.nbytes, "aten-int4": aten_codes.numel() + aten_sz.numel() * 2,
             "int8": i8_codes.numel() + out * 2, "vnni-int8": int8.nbytes, "bf16": bf16.numel() * 2}
    return {p: [make() for _ in range(max(1, copies // sizes[p]) if copies else 1)] for p, make in peers.items()}


def _call(peer: str, x: torch.Tensor, w) -> torch.Tensor:
    if peer in ("vnni", "int8", "vnni-int8"):
        return ops.linear(x, w)
    if peer == "aten-int4":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1])
    return F.linear(x, w)


def _time(peer: str, x: torch.Tensor, ws: list, min_time: float) -> float:
    """Seconds per call, cycling through the copies."""
    n, start, i = 0, time.perf_counter(), 0
    while True:
        for _ in range(8):
            _call(peer, x, ws[i])
            i = (i + 1) % len(ws)
        n += 8
        elapsed = time.perf_counter() - start
        if elapsed >= min_time:
            return elapsed / n


def run(ns: argparse.Namespace) -> int:
    torch.set_num_threads(ns.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in ns.shapes.split(",")]
    ms = [int(v) for v in ns.m.split(",")]
    copies = 0 if ns.hot else int(ns.cold_bytes * (1 << 20))
    print(f"threads={ns.threads} {'hot' if ns.hot else f'cold ({ns.cold_bytes:.0f} MiB of copies per peer)'} "
          f"rounds={ns.rounds}; x bf16; microseconds per matmul (best round), ratio = peer / vnni")
    print(f"{'shape':>10} {'M':>3} " + " ".join(f"{p:>10}" for p in PEERS) + "  " +
          " ".join(f"{p + '/vnni':>14}" for p in PEERS[1:]))
    for si, (out, inner) in enumerate(shapes):
        ws = _weights(out, inner, copies, seed=si)
        for m in ms:
            x = torch.randn(m, inner, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
            ref = F.linear(x.float(), ws["bf16"][0].float())
            for p in PEERS:  # a sanity check that every peer multiplies the same weight
                err = (_call(p, x, ws[p][0]).float() - ref).abs().max() / ref.abs().max()
                assert err < 0.1, (p, err.item())
            best = {p: float("inf") for p in PEERS}
            for _ in range(ns.rounds):
                for p in PEERS:
                    best[p] = min(best[p], _time(p, x, ws[p], ns.min_time))
            us = {p: best[p] * 1e6 for p in PEERS}
            print(f"{out}x{inner:<5} {m:>3} " + " ".join(f"{us[p]:>10.1f}" for p in PEERS) + "  " +
                  " ".join(f"{us[p] / us['vnni']:>13.2f}x" for p in PEERS[1:]), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main("bench-int4", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
