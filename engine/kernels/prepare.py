"""Every kernel choice of this process made before anything waits on it, and the builds ahead of time.

Interface:
  prepare(on_progress=None, jobs=None) -> list[KernelChoice]
      Resolves each loader of engine.kernels (int4_backend, fused_ops, attention_ops, bf16_rows,
      decode_block, ggml_repack), building the kernels this CPU will use, `jobs` builds at a time
      (default: one per core). The loaders cache their choice for the process, so after this no
      request path can reach a compiler, and a cache folder removed while the process runs changes
      nothing (the libraries stay loaded). The engine calls it at start-up; `on_progress(BuildProgress)`
      hears each build start and end (str(): "building kernels: a, b (2/6 done)", which the
      server's /health shows).
  build_every_kernel(on_progress=None, jobs=None) -> list[KernelChoice]
      Compiles every kernel source whatever this CPU supports (`layerstream build-kernels --all`):
      the libraries use explicit instruction-set flags, not -march=native, and each checks the CPU
      when it is chosen, so an image built on one x86-64 machine carries them for every other.
  KERNELS: the kernels' names and build specs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from . import NAME as INT4_NAME
from . import INCLUDES as INT4_INCLUDES
from . import SOURCE as INT4_SOURCE
from . import attention_ops, bf16_rows, build, decode_block, fused_ops, ggml_repack, int4_backend, kv_attention

log = logging.getLogger("layerstream")

STOP_POLL_S = 0.2  # how often a wait for builds looks whether the process is stopping


@dataclass(frozen=True)
class KernelSpec:
    """One C++ kernel: what build.compile_extension needs, and the loader that decides whether this
    process uses it (it returns the module, a backend name, or None for the logged fallback)."""

    name: str
    library: str  # the extension's module name (its build folder's prefix)
    source: Path
    cflags: tuple[str, ...]
    includes: tuple[Path, ...]
    choose: Callable[[], object]


@dataclass(frozen=True)
class KernelChoice:
    name: str
    in_use: bool


@dataclass(frozen=True)
class BuildProgress:
    """What on_progress hears each time a build starts or ends."""

    running: tuple[str, ...]
    done: int
    total: int

    def __str__(self) -> str:
        return f"building kernels: {', '.join(self.running) or '-'} ({self.done}/{self.total} done)"


# Two stages: decode_block is made of the first stage's kernels and ggml_repack writes their layouts,
# so their loaders ask the first stage's choices.
KERNELS: tuple[tuple[KernelSpec, ...], ...] = (
    (KernelSpec("int4_vnni", INT4_NAME, INT4_SOURCE, build.CFLAGS, INT4_INCLUDES, lambda: int4_backend() == "vnni"),
     KernelSpec("fused_ops", fused_ops.NAME, fused_ops.SOURCE, fused_ops.CFLAGS, fused_ops.INCLUDES,
                fused_ops.fused_ops),
     KernelSpec("attention_ops", attention_ops.NAME, attention_ops.SOURCE, attention_ops.BUILD_FLAGS, (),
                attention_ops.attention_ops),
     KernelSpec("bf16_rows", bf16_rows.NAME, bf16_rows.SOURCE, build.CFLAGS, bf16_rows.INCLUDES,
                bf16_rows.bf16_rows),
     KernelSpec("kv_attention", kv_attention.NAME, kv_attention.SOURCE, kv_attention.CFLAGS, kv_attention.INCLUDES,
                kv_attention.kv_attention)),
    (KernelSpec("decode_block", decode_block.NAME, decode_block.SOURCE, decode_block.CFLAGS, decode_block.INCLUDES,
                decode_block.decode_block),
     KernelSpec("ggml_repack", ggml_repack.NAME, ggml_repack.SOURCE, ggml_repack.CFLAGS, (), ggml_repack.ggml_repack)),
)


def prepare(on_progress: Callable[[BuildProgress], None] | None = None, jobs: int | None = None) -> list[KernelChoice]:
    def choose(spec: KernelSpec) -> KernelChoice:
        result = spec.choose()
        return KernelChoice(spec.name, result is not None and result is not False)

    return _run_stages(choose, on_progress, jobs)


def build_every_kernel(on_progress: Callable[[BuildProgress], None] | None = None,
                       jobs: int | None = None) -> list[KernelChoice]:
    def compile_one(spec: KernelSpec) -> KernelChoice:
        module, why = build.compile_or_reason(spec.library, spec.source, spec.cflags, spec.includes)
        if module is None:
            log.warning("the %s kernel %s", spec.name, why)
        return KernelChoice(spec.name, module is not None)

    return _run_stages(compile_one, on_progress, jobs)


def _run_stages(work: Callable[[KernelSpec], KernelChoice], on_progress: Callable[[BuildProgress], None] | None,
                jobs: int | None) -> list[KernelChoice]:
    total = sum(len(stage) for stage in KERNELS)
    running: list[str] = []
    done: list[KernelChoice] = []
    lock = threading.Lock()

    def report() -> None:
        if on_progress is not None:
            on_progress(BuildProgress(tuple(running), len(done), total))

    def one(spec: KernelSpec) -> KernelChoice:
        with lock:
            running.append(spec.name)
            report()
        try:
            choice = work(spec)
        finally:
            with lock:
                running.remove(spec.name)
        with lock:
            done.append(choice)
            report()
        return choice

    workers = max(1, jobs or os.cpu_count() or 1)
    results: list[KernelChoice] = []
    futures: list[Future] = []
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="layerstream-kernel-build") as pool:
        try:
            for stage in KERNELS:
                futures = [pool.submit(one, spec) for spec in stage]
                _wait_for(futures)
                results += [f.result() for f in futures]
        except BaseException:
            # Ctrl-C (or any failure) here: the pool would otherwise wait for every build in flight.
            for f in futures:
                f.cancel()
            build.stop_builds()
            _wait_for(futures)
            raise
    return results


def _wait_for(futures: list[Future]) -> None:
    """Until every one of `futures` is done. Once the process is stopping (build.stop_builds), its builds are
    stopped again at every turn: a build whose compiler was starting when stop_builds() looked (forked, not
    yet `ninja`) is not among the processes it found, and would otherwise run to its end (minutes) while
    the process that was told to stop waits for it."""
    while wait(futures, timeout=STOP_POLL_S).not_done:
        if build.stopping():
            build.stop_builds()


def describe(choices: Sequence[KernelChoice]) -> str:
    """One line: which kernels this process uses and which fell back (each fallback's reason is
    logged by its loader)."""
    used = [c.name for c in choices if c.in_use]
    other = [c.name for c in choices if not c.in_use]
    return f"kernels in use: {', '.join(used) or 'none'}; torch fallbacks: {', '.join(other) or 'none'}"
