"""`layerstream build-kernels`: build the C++ kernels ahead of time (scripts/setup.sh and the image
build run it), so neither start-up nor a request waits on a compiler later."""

from __future__ import annotations

import argparse
import os
import sys

from .prepare import BuildProgress, build_every_kernel, describe, prepare


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--all", action="store_true",
                   help="compile every kernel whatever this CPU supports (an image built here runs on other "
                        "x86-64 CPUs; each kernel checks the CPU it runs on when it is chosen)")
    p.add_argument("--jobs", type=int, default=None, help="builds at a time (default: one per core)")


def run(ns: argparse.Namespace) -> int:
    from tqdm import tqdm

    if ns.jobs is not None and ns.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {ns.jobs}")
    bar = tqdm(total=None, unit="kernel", file=sys.stderr, desc="building kernels", dynamic_ncols=True)

    def progress(p: BuildProgress) -> None:
        bar.total = p.total
        bar.n = p.done
        bar.set_postfix_str(", ".join(p.running), refresh=True)

    with bar:
        choices = (build_every_kernel if ns.all else prepare)(progress, ns.jobs)
    if ns.all:
        failed = [c.name for c in choices if not c.in_use]
        print(f"built {len(choices) - len(failed)} kernels" + (f"; failed: {', '.join(failed)}" if failed else ""),
              file=sys.stderr)
        return 1 if failed else 0
    print(describe(choices), file=sys.stderr)
    from ..cache import cache_root

    print(f"kernel cache: {os.fspath(cache_root() / 'kernels')}", file=sys.stderr)
    return 0
