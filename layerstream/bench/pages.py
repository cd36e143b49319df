"""`layerstream bench-pages`: how fast the int4 kernel streams weights from a file the page cache holds in 4 KiB
pages lying anywhere in memory (mapped 4 KiB at a time), from the same bytes held in huge folios and mapped 2 MiB
at a time (the prepacked entry's writer and mapping: engine/weights/packed/chunked_file.py, formats/views.py
map_file), and from anonymous memory.

The weights: the 3B benchmark model's block matrices (q/k/v stacked 5120x3072, o 3072x3072, gate/up stacked
16384x3072, down 3072x8192) in the int4 kernel's symmetric layout (Q4_0's: codes and one float16 scale per 32),
random bytes, repeated block by block up to --mib. They are written twice. Once 4 KiB at a time in a shuffled
order, mapped plainly: the page cache's pages then lie wherever the allocator had them rather than in file
order, as in a page cache that has been filled and reclaimed for hours (docs/benchmarks/pages.md). Once by
ChunkedFileWriter and mapped by map_file. The third copy is torch's anonymous allocation. Each round runs
one decode row (x: 1 x in, bf16) through every matrix of each copy in turn, so the machine's drifting memory
bandwidth hits every copy alike; medians over the rounds. The torch-sum probe that bench-scale's memory floor
uses is printed after them.

    layerstream bench-pages                 # 1.5 GiB of weights, 2 threads, 15 rounds
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from .common import BENCH_ROOT, machine_description

SHAPES = ((5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192))  # one 3B block's matrices (out, in)
GROUP = 32
MADV_POPULATE_READ = 22


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mib", type=int, default=1536, help="MiB of weights (more than the CPU's caches)")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dir", default=str(BENCH_ROOT), help="where the two files are written (then removed)")


def _parts(mib: int) -> list[tuple[tuple[int, int], int, int]]:
    """((out, in), codes bytes, scales bytes) of each matrix, block by block, up to mib MiB."""
    out, total = [], 0
    while total < mib << 20:
        for n, k in SHAPES:
            codes, scales = n // 16 * (k // GROUP * 256), n // 16 * (k // GROUP) * 16 * 2
            out.append(((n, k), codes, scales))
            total += codes + scales
    return out


def _write(path: Path, data, chunked: bool) -> None:
    """data ((n,) uint8 numpy) to path: by ChunkedFileWriter, or 4 KiB at a time in a shuffled order."""
    from engine.weights.probes import ChunkedFileWriter

    with open(path, "wb") as f:
        if chunked:
            out = ChunkedFileWriter(f.fileno())
            out.write(0, data)
            out.flush()
        else:  # 4 KiB pieces in a shuffled order: pages lie wherever the allocator had them, not in file order
            import random

            pieces = list(range(0, data.size, 4096))
            random.Random(0).shuffle(pieces)
            f.truncate(data.size)
            for at in pieces:
                os.pwrite(f.fileno(), data[at:at + 4096], at)
        f.flush()
        os.fsync(f.fileno())


def _weights(buf, parts, keep: list):
    """Int4Weight views of buf (the parts back to back), each (codes, scales) pair as the kernel reads them."""
    import torch

    from engine.weights import Int4Weight

    base = torch.frombuffer(buf, dtype=torch.uint8)
    keep.append(base)
    out, at = [], 0
    for (n, k), nc, ns in parts:
        codes = base[at:at + nc].view(n // 16, -1)
        scales = base[at + nc:at + nc + ns].view(torch.float16).view(n // 16, k // GROUP, 16)
        out.append(Int4Weight(codes, scales, (n, k), "vnni"))
        at += nc + ns
    return out


def run(ns: argparse.Namespace) -> int:
    import torch

    from engine import ops
    from engine.kernels import int4_backend
    from engine.weights.probes import file_mappings, map_file

    from .scale import memory_gbps

    if int4_backend() != "vnni":
        sys.exit("bench-pages times the VNNI int4 kernel, which does not run on this CPU")
    torch.set_num_threads(ns.threads)
    parts = _parts(ns.mib)
    nbytes = sum(c + s for _, c, s in parts)
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    halves = data.view(torch.float16)
    halves[:] = torch.nan_to_num(halves.abs(), nan=0.0).clamp(max=1.0)  # finite scales (random bytes hold NaNs)
    keep: list = []
    with tempfile.TemporaryDirectory(dir=ns.dir) as tmp:
        small, huge = Path(tmp) / "small-pages.bin", Path(tmp) / "huge-pages.bin"
        _write(small, data.numpy(), chunked=False)
        _write(huge, data.numpy(), chunked=True)
        fds = [os.open(p, os.O_RDONLY) for p in (small, huge)]
        plain = mmap.mmap(fds[0], 0, access=mmap.ACCESS_COPY)  # no huge-page hint: as checkpoints were mapped before
        hinted = map_file(fds[1])
        plain.madvise(MADV_POPULATE_READ)
        hinted.madvise(MADV_POPULATE_READ)
        copies = {"file, 4 KiB scattered": _weights(plain, parts, keep), "file, huge folios": _weights(hinted, parts, keep),
                  "anonymous memory": _weights(data.numpy(), parts, keep)}
        paged = file_mappings()
        x = {k: torch.randn(1, k).bfloat16() for _, k in SHAPES}
        times: dict[str, list[float]] = {name: [] for name in copies}
        for _ in range(ns.rounds):
            for name, weights in copies.items():
                t0 = time.perf_counter()
                for w in weights:
                    ops.linear(x[w.shape[1]], w)
                times[name].append(time.perf_counter() - t0)
        probe = memory_gbps(ns.threads)
        shares = {name: paged.get(os.path.realpath(p), (0, 0)) for name, p in
                  (("file, 4 KiB scattered", small), ("file, huge folios", huge))}
        keep.clear()
        copies.clear()
        del plain, hinted  # views are gone: the mappings close with their last reference
        for fd in fds:
            os.close(fd)
    print(machine_description())
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    print(f"{len(parts)} int4 matrices (3B block shapes, symmetric), {nbytes / 2**30:.2f} GiB; one bf16 decode row; "
          f"{ns.threads} threads; medians of {ns.rounds} alternating rounds; load average {load}")
    base = statistics.median(times["file, 4 KiB scattered"])
    print(f"{'weights in':<22} {'ms':>8} {'GB/s':>6} {'vs 4 KiB':>9}  paged")
    for name, ts in times.items():
        t = statistics.median(ts)
        rss, hp = shares.get(name, (0, 0))
        where = f"{hp / max(rss, 1):.0%} of {rss / 2**20:.0f} MiB mapped in huge pages" if name in shares else "torch's allocation"
        print(f"{name:<22} {t * 1e3:8.1f} {nbytes / t / 1e9:6.1f} {base / t:8.2f}x  {where}")
    print(f"memory read probe (bench-scale's floor): {probe:.1f} GB/s, fastest torch sum over 2 GiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .common import bench_main

    return bench_main("layerstream bench-pages", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
