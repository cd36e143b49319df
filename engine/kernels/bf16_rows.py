"""bf16 products of 1-16 rows (bf16_rows.cpp) for decode steps of a few sequences, with a logged fallback.

Interface:
  bf16_rows() -> module | None   the compiled kernel, or None when engine/ops.py keeps F.linear: the
      CPU lacks AVX512-BF16 (or AVX512 F/BW/DQ), the CPU has AMX (oneDNN then multiplies 2-16 rows with
      its tile unit, at about the cost of one row and faster than this kernel: onednn_has_amx), the
      extension cannot be built (no compiler, no ninja, a build error), or LAYERSTREAM_BF16_ROWS=off asks
      for that (auto, the default: the kernel where it builds, runs and beats oneDNN). The reason is
      logged once. Decided once per process; tests reset it with `bf16_rows.cache_clear()`.
      decode_block.cpp has the kernel built in and is told per call whether to use it (engine/ops.py
      passes `_few_bf16_rows(x)`, what its linear decides).
  built() -> module | None   the kernel wherever it builds and runs, AMX or not: for its tests and
      layerstream/bench/bf16_rows.py, which compare it with oneDNN.
  The module: linear(x, w, bias=None) -> x @ w.T + bias, the kernel where applies(x, w) (bf16, 1-16
      contiguous rows, K a multiple of 32), at::linear otherwise; MAX_ROWS (16).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from . import onednn_has_amx
from .build import CFLAGS, optional_kernel

SOURCE = Path(__file__).with_name("bf16_rows.cpp")
NAME = "layerstream_bf16_rows"


WHAT = "bf16 products of 1-16 rows: using F.linear, not the AVX512-BF16 kernel"


def _blocked() -> str | None:
    # With AMX oneDNN multiplies 16 rows faster than this kernel, at about the cost of one row, and the
    # served 16 streams ran faster with it: docs/benchmarks/bf16-rows.md and paged.md.
    return "oneDNN multiplies them on this CPU's AMX tiles, faster" if onednn_has_amx() else None


@functools.cache
def bf16_rows() -> ModuleType | None:
    return optional_kernel("LAYERSTREAM_BF16_ROWS", "off", WHAT, NAME, SOURCE, CFLAGS, blocked=_blocked,
                           cpu_check="the CPU lacks AVX512-BF16", blocked_level=logging.INFO)


@functools.cache
def built() -> ModuleType | None:
    return optional_kernel("LAYERSTREAM_BF16_ROWS", "off", WHAT, NAME, SOURCE, CFLAGS,
                           cpu_check="the CPU lacks AVX512-BF16")
