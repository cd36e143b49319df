"""bf16 products of 2-16 rows (bf16_rows.cpp) for decode steps of a few sequences, with a logged fallback.

Interface:
  bf16_rows() -> module | None   the compiled kernel, or None when engine/model.py keeps F.linear: the
      CPU lacks AVX512-BF16 (or AVX512 F/BW/DQ), the extension cannot be built (no compiler, no ninja, a
      build error), or LAYERSTREAM_BF16_ROWS=off asks for that (auto, the default: the kernel where it
      builds and runs). The reason is logged once. Decided once per process; tests reset it with
      `bf16_rows.cache_clear()`. decode_block.cpp has the kernel built in and is told per call whether
      to use it (engine/model.py passes `_few_bf16_rows(x)`, what its linear decides).
  The module: linear(x, w, bias=None) -> x @ w.T + bias, the kernel where applies(x, w) (bf16, 2-16
      contiguous rows, K a multiple of 32), at::linear otherwise; MAX_ROWS (16).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from .build import CFLAGS, optional_kernel

SOURCE = Path(__file__).with_name("bf16_rows.cpp")
NAME = "layerstream_bf16_rows"


@functools.cache
def bf16_rows() -> ModuleType | None:
    return optional_kernel("LAYERSTREAM_BF16_ROWS", "off",
                           "bf16 products of 2-16 rows: using F.linear, not the AVX512-BF16 kernel", NAME, SOURCE,
                           CFLAGS, cpu_check="the CPU lacks AVX512-BF16")
