"""bf16 products of 1-16 rows (bf16_rows.cpp) for decode steps of a few sequences, with a logged fallback.

Interface:
  bf16_rows() -> module | None   the compiled kernel, or None when engine/ops.py keeps F.linear: the
      CPU lacks AVX512-BF16 (or AVX512 F/BW/DQ), the extension cannot be built (no compiler, no ninja, a
      build error), or LAYERSTREAM_BF16_ROWS=off asks for that (auto, the default: the kernel where it
      builds and runs). The reason is logged once. Decided once per process; tests reset it with
      `bf16_rows.cache_clear()`. Where the CPU has AMX, oneDNN multiplies 2-16 rows with its tile unit at
      about the cost of one row, faster than this kernel, so engine/ops.py gives the kernel one row only
      (max_rows()).
      decode_block.cpp has the kernel built in and is told per call whether to use it (engine/ops.py
      passes `_few_bf16_rows(x)`, what its linear decides).
  max_rows(module) -> int   the most rows engine/ops.py gives it: 1 with AMX, else MAX_ROWS.
  The module: linear(x, w, bias=None) -> x @ w.T + bias, the kernel where applies(x, w) (bf16, 1-16
      contiguous rows, K a multiple of 32), at::linear otherwise; MAX_ROWS (16).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from . import onednn_has_amx
from .build import CFLAGS, optional_kernel

SOURCE = Path(__file__).with_name("bf16_rows.cpp")
NAME = "layerstream_bf16_rows"
INCLUDES = (Path(__file__).with_name("stream_prefetch.h"),)  # what bf16_rows.cpp #includes


WHAT = "bf16 products of 1-16 rows: using F.linear, not the AVX512-BF16 kernel"


def max_rows(module: ModuleType) -> int:
    """The most rows a product gives the kernel: with AMX oneDNN multiplies 2-16 rows faster than it, at
    about the cost of one row, and the served 16 streams ran faster with it; one row the kernel streams
    faster than oneDNN there too (docs/benchmarks/bf16-rows.md). Without AMX, all of MAX_ROWS."""
    return 1 if onednn_has_amx() else module.MAX_ROWS


@functools.cache
def bf16_rows() -> ModuleType | None:
    return optional_kernel("LAYERSTREAM_BF16_ROWS", "off", WHAT, NAME, SOURCE, CFLAGS, INCLUDES,
                           cpu_check="the CPU lacks AVX512-BF16")

