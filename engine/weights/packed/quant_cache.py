"""Quantization at load, done once per checkpoint and kept in the layerstream cache.

An entry is a folder `quantized-v{VERSION}/{key}` under engine.cache.cache_root(), never beside the
user's model files. It holds `model.safetensors` with every block's quantized projections and the
int8 head (quantize.py says what is quantized and how), and `digest.json` with that file's sha256.
The key hashes the checkpoint's identity (each file's name, size, modification time, first MiB and
samples spread over its data), the mode, the compute dtype, torch's version and the int4/int8 layout
(engine.ops.int4_layout(): our VNNI kernels', or aten's, which may change with torch). A later
load maps the file (zero-copy views, paged in on use) instead of quantizing again; an entry whose
file no longer matches its digest (truncated, overwritten) is removed and built again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import torch

from ... import ops
from ...cache import build_once, cache_root
from ...errors import CheckpointError
from .weights import Int4Weight, Int8Weight
from .quantize import PROJECTIONS, quantize_head, quantize_weight
from ..formats.safetensors_index import DTYPES, SafetensorsFile
from ..formats.block_source import BlockSource
from ..transports.base import to_compute

log = logging.getLogger("layerstream")

VERSION = 3  # bump when what an entry holds changes (2: int4 parts q4/q4_scales; 3: int8 in the kernel's layout too)
MARKER = "layerstream-quantized.json"
DATA, DIGEST = "model.safetensors", "digest.json"
HEAD_BYTES, SAMPLE_BYTES, SAMPLES = 1 << 20, 64 << 10, 16
# The entry's file holds integer codes besides the compute-dtype scales.
CACHE_DTYPES = {**DTYPES, "I8": torch.int8, "U8": torch.uint8}


def checkpoint_identity(files: list[Path]) -> str:
    """A digest that changes when any file of the checkpoint does: names, sizes and modification
    times, plus the bytes of each file's start (its header) and of SAMPLES pieces spread over it.
    Reading the whole checkpoint would cost as much as quantizing it again."""
    h = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.name):
        st = os.stat(path)
        h.update(f"{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(HEAD_BYTES))
            for i in range(SAMPLES):
                f.seek(st.st_size * i // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def kernel_layout() -> str:
    """The layout an entry's int4 and int8 weights (the head is int8 in every entry) are stored in:
    this process's kernels'."""
    return ops.int4_layout()


def entry_folder(source: BlockSource, mode: str, dtype: torch.dtype) -> Path:
    key = hashlib.sha256("\0".join([checkpoint_identity(source.files), mode, str(dtype),
                                    torch.__version__, kernel_layout()]).encode()).hexdigest()[:32]
    return cache_root() / f"quantized-v{VERSION}" / key


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _parts(prefix: str, w) -> dict[str, torch.Tensor]:
    if isinstance(w, Int8Weight):
        return {f"{prefix}.codes": w.codes, f"{prefix}.scales": w.scales}
    return {f"{prefix}.q4": w.codes, f"{prefix}.q4_scales": w.scales}


class QuantizedBlocks:
    """Every block's quantized projections and the int8 head of a plain checkpoint, from a cache entry
    (built on the first load). Owns the entry's mapping until close()."""

    def __init__(self, source: BlockSource, mode: str, dtype: torch.dtype,
                 on_progress: Callable[[int], None] | None = None):
        self.source, self.mode, self.dtype = source, mode, dtype
        self.layout = kernel_layout()
        self.folder = entry_folder(source, mode, dtype)
        self.built = False  # this load quantized (the cache had no usable entry)
        self._shapes = [source.shapes(b) for b in range(source.num_blocks)]
        self._file = self._open(on_progress)

    def _open(self, on_progress) -> SafetensorsFile:
        for attempt in (1, 2):
            folder = build_once(self.folder, MARKER, {"version": VERSION, "mode": self.mode, "dtype": str(self.dtype),
                                                  "layout": self.layout},
                                lambda tmp: self._build(tmp, on_progress))
            try:
                recorded = json.loads((folder / DIGEST).read_text())["sha256"]
                if file_sha256(folder / DATA) != recorded:
                    raise CheckpointError(f"{folder / DATA}: sha256 does not match {DIGEST}")
                f = SafetensorsFile(folder / DATA, dtypes=CACHE_DTYPES)
                self._check(f)
                return f
            except (OSError, ValueError, KeyError, CheckpointError) as e:
                if attempt == 2:
                    raise CheckpointError(f"{folder}: the quantization cache entry just built is unusable: {e}") from e
                log.warning("%s: quantization cache entry is damaged (%s); building it again", folder, e)
                shutil.rmtree(folder, ignore_errors=True)
        raise AssertionError("unreachable")

    def _check(self, f: SafetensorsFile) -> None:
        """Every tensor this checkpoint's blocks need is in the entry (a key collision or a stale
        layout would otherwise fail in the middle of a step)."""
        need = [f"{b}.{k}" for b in range(self.source.num_blocks) for k in self.source.shapes(b) if k in PROJECTIONS]
        have = {name.rsplit(".", 1)[0] for name in f.entries}
        missing = [n for n in need + ["lm_head"] if n not in have]
        if missing:
            f.close()
            raise CheckpointError(f"entry lacks {', '.join(missing[:3])}")

    def _build(self, tmp: Path, on_progress) -> None:
        from safetensors.torch import save_file

        log.info("quantizing %d blocks to %s once (cached in %s)", self.source.num_blocks, self.mode, self.folder)
        cpu = torch.device("cpu")
        tensors: dict[str, torch.Tensor] = {}
        for b in range(self.source.num_blocks):
            views = {k: v for k, v in self.source.views(b).items() if k in PROJECTIONS}
            for k, w in to_compute(views, self.dtype, cpu, copy=False).items():
                tensors.update(_parts(f"{b}.{k}", quantize_weight(w, self.mode, self.dtype)))
            if on_progress:
                on_progress(b)
        glob = self.source.global_views()
        head = to_compute({"h": glob.get("lm_head", glob["embed"])}, self.dtype, cpu, copy=False)["h"]
        tensors.update(_parts("lm_head", quantize_head(head, self.dtype)))
        tmp.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / DATA))
        (tmp / DIGEST).write_text(json.dumps({"sha256": file_sha256(tmp / DATA)}))
        self.built = True

    def _view(self, name: str) -> torch.Tensor:
        return self._file.view(self._file.entries[name])

    def _weight(self, prefix: str, shape: tuple[int, ...]):
        if f"{prefix}.codes" in self._file.entries:
            return Int8Weight(self._view(f"{prefix}.codes"), self._view(f"{prefix}.scales"), shape)
        return Int4Weight(self._view(f"{prefix}.q4"), self._view(f"{prefix}.q4_scales"), shape, self.layout)

    def block(self, b: int) -> dict[str, object]:
        """Block b's quantized projections: zero-copy views of the mapped entry."""
        return {k: self._weight(f"{b}.{k}", s) for k, s in self._shapes[b].items() if k in PROJECTIONS}

    def head(self) -> Int8Weight:
        """The int8 head, copied out of the mapping (it is resident)."""
        glob = self.source.global_views()
        shape = tuple(glob.get("lm_head", glob["embed"]).shape)  # (vocab, hidden)
        return self._weight("lm_head", shape).clone()

    def nbytes(self, b: int) -> int:
        return sum(w.nbytes for w in self.block(b).values())

    def advise(self, b: int, advice: int) -> None:
        for k in self._shapes[b]:
            if k in PROJECTIONS:
                for name in (n for n in self._file.entries if n.startswith(f"{b}.{k}.")):
                    e = self._file.entries[name]
                    self._file.advise(e.start, e.end, advice)

    def close(self) -> None:
        self._file.close()
