"""bf16 products of 2-8 rows (bf16_rows.cpp) for decode steps of a few sequences, with a logged fallback.

Interface:
  bf16_rows() -> module | None   the compiled kernel, or None when engine/model.py keeps F.linear: the
      CPU lacks AVX512-BF16 (or AVX512 F/BW/DQ), the extension cannot be built (no compiler, no ninja, a
      build error), or LAYERSTREAM_BF16_ROWS=off asks for that (auto, the default: the kernel where it
      builds and runs). The reason is logged once. Decided once per process; tests reset it with
      `bf16_rows.cache_clear()`. decode_block.cpp has the kernel built in and is told per call whether
      to use it (engine/model.py passes `bf16_rows() is not None`).
  The module: linear(x, w, bias=None) -> x @ w.T + bias, the kernel where applies(x, w) (bf16, 2-8
      contiguous rows, K a multiple of 32), at::linear otherwise; MAX_ROWS.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

from .build import CFLAGS, compile_or_reason

log = logging.getLogger("layerstream")

SOURCE = Path(__file__).with_name("bf16_rows.cpp")
NAME = "layerstream_bf16_rows"
MODES = ("auto", "off")


@functools.cache
def bf16_rows() -> ModuleType | None:
    wanted = os.environ.get("LAYERSTREAM_BF16_ROWS", "auto")
    if wanted not in MODES:
        raise ValueError(f"LAYERSTREAM_BF16_ROWS must be auto or off, got {wanted!r}")
    if wanted == "off":
        reason = "LAYERSTREAM_BF16_ROWS=off"
    else:
        module, why = compile_or_reason(NAME, SOURCE, CFLAGS)
        if module is not None and module.cpu_supported():
            return module
        reason = f"it {why}" if module is None else "the CPU lacks AVX512-BF16"
    log.warning("bf16 products of 2-8 rows: using F.linear, not the AVX512-BF16 kernel: %s", reason)
    return None
