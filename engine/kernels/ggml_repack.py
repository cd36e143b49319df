"""The C++ repack of streamed GGUF blocks into the VNNI kernels' layouts (ggml_repack.cpp), or None.

Interface:
  ggml_repack() -> module | None   the compiled repack, or None when streamed GGUF blocks keep their
      GGML bytes and are dequantized by the matmul that uses them (the fallback): when the VNNI
      kernels themselves do not run (int4_backend() == "aten": the layouts it writes are theirs), when
      LAYERSTREAM_STREAM_REPACK=off asks for that (auto, the default: repack where it builds), or when
      the extension cannot be built. The reason is logged once; decided once per process (tests reset it
      with `ggml_repack.cache_clear()`).
  The module: repack_int4(rows, qtype, K, codes, scales, order=None) for Q4_0/Q4_1/Q4_K and
      repack_int8(rows, qtype, K, codes, scales, order=None) for Q8_0/Q5_0/Q5_1/Q5_K/Q6_K, writing into
      the caller's `codes` / `scales` (Int4Weight / Int8Weight "vnni", engine/weights/packed/weights.py); rows
      (out, bytes per row) uint8 as stored, `order` the engine row order (rows to take, int64);
      repack_kquant(rows, qtype, K, codes, scales, order=None) for Q4_K/Q6_K into KQuantWeight's layouts.

Built with the VNNI kernels' instruction-set flags (it runs only beside them) and without FMA
contraction, so its arithmetic rounds as the torch code it replaces does.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from . import build, int4_backend

SOURCE = Path(__file__).with_name("ggml_repack.cpp")
NAME = "layerstream_ggml_repack"
# The VNNI kernels' instruction sets (it only runs where they do), so the loops vectorize; no FMA
# contraction (a*b + c rounds twice, as torch's separate ops); no trapping math / errno, which change
# no result but let nearbyint and the clamps compile to vector instructions.
CFLAGS = (*build.CFLAGS, "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno")


def _blocked() -> str | None:
    return None if int4_backend() == "vnni" else "the VNNI kernels are not in use (aten's int4/int8 kernels are)"


@functools.cache
def ggml_repack() -> ModuleType | None:
    return build.optional_kernel("LAYERSTREAM_STREAM_REPACK", "off",
                                 "streamed GGUF blocks: dequantized by each matmul, not repacked for the VNNI kernels",
                                 NAME, SOURCE, CFLAGS, blocked=_blocked)
