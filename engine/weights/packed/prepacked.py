"""GGUF blocks stored once in the CPU kernels' layout: the prepacked cache entry.

In CPU fast mode with the VNNI kernels, a GGUF block is computed in its repacked form: int4 / int8
VNNI codes and scales, q/k/v and gate/up stacked, norms and biases in the compute dtype
(stream_repack.py writes it, byte for byte the load-time repack's). Without this module that form
is made again at every load for resident blocks, and at every step for streamed ones. Here it is
made once per GGUF file (on the first load, or ahead of time by `layerstream convert`) and written
to `prepacked-v{VERSION}/{key}/blocks.bin` under engine.cache.cache_root(), never beside the user's
file. Later loads map it: resident and streamed blocks are zero-copy views of the mapping (page
cache), or read from it by the disk tier (transports/prepacked.py). Nothing is repacked per step. It is
written in whole aligned chunks (chunked_file.py) and mapped asking for huge pages (views.map_file), so
that the page cache holds it, and the mapping maps it, 2 MiB at a time where the kernel can. The
head (the tied token table where there is no lm_head) is stored after the blocks in its compute form
too, and mapped the same way.

The file: an 8-byte little-endian length and the JSON header (the layout: each block's offset and
bytes; each weight's kind, logical shape and parts, a part being an offset in its block, a dtype
and a shape), padded to a page; then the blocks in order, each starting on a page and padded to
one, so the disk tier reads a block with one aligned O_DIRECT request. A block holds exactly what
StreamRepacker.fill makes of it; the head, laid out as a block of one weight ("head"), what
PackedFormat.resident makes of it. An int4 weight made of Q4_0 rows only (kind "int4s") is stored in the
symmetric form (its mins are -8 * its scales: Int4Weight.without_min), the scales alone: the same
products from 10% fewer bytes, for resident and streamed blocks alike. Q4_K and Q6_K weights keep their
sub-scales (kinds "q4k", "q6k": KQuantWeight), so the entry is no larger than the file's bytes.

The key hashes the GGUF's identity (quant_cache.checkpoint_identity: names, sizes, modification
times, sampled bytes), the compute dtype, torch's version, the kernel layout and VERSION (bump it
when the repack's bytes change). Every load checks the entry without reading all of it: its size,
the sha256 of its header and of SAMPLES pieces spread over its blocks (digest.json), and that the
header is the one this code would write (a layout change without a VERSION bump is stale too). A
stale or damaged entry is removed and built again.

A mixture of experts' block (the MoE GGUF families: DeepSeek-V2/V3, GPT-OSS) is laid out the same way: its routed
experts' tensors ("experts.{e}.w_gate", "w_up", "w_down", each its own weight, as the load-time repack makes them)
follow its attention and shared expert, one expert's matrices back to back (one range of the block: what a read of
one expert would take; GPT-OSS's expert biases lie with the kept tensors), then the kept tensors (norms, the router,
and any quantized tensor other than a matrix, such as DeepSeek's per-head k_b / v_b stacks, dequantized to the
compute dtype as the load and the repacker make them). Resident and whole-block streamed MoE blocks are views of the
mapping like any other; routed experts placed off the device (engine.placement) are the CPU's views of it, priced
and moved at their parts' bytes. The expert-granular tier (plan.expert_streaming) serves a GGUF file's experts from
here: ModelCheckpoint.sizes prices a block without its experts and one expert at their parts (dense_bytes,
expert_bytes); blocks are handed out without their experts (keep), advise() faulting in only their weights' pages,
and each chosen expert is expert(): zero-copy views of its range, faulted in by the fill. The disk tier reads no
single expert from the entry yet: with disk-tier blocks (or the disk transport) the loader plans MoE blocks whole.

Where it does not apply, the paths before it stay: fp32 exact mode and the aten fallback (no
repack: stream_repack.make_repacker is None), LAYERSTREAM_PREPACK=off, or a cache that cannot be
written (ModelWeights then warns).

With tensor groups placed below the block (engine.placement), the same entry serves both sides of each block:
PrepackedBlocks(keep=...) hands out only the weights on the device, or only those off it (whose views the CPU
computes from, or the simulated link moves: their parts' bytes, not the block's pages).
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ...cache import build_once, cache_root
from ...errors import CheckpointError
from ..formats.reader import TensorInfo
from .weights import INT4_TYPES, KQUANT_BYTES, Int4Weight, Int8Weight, KQuantWeight, vnni_parts
from .compute_form import PackedFormat, kquant_layout
from .quant_cache import checkpoint_identity, kernel_layout
from ..formats.block_source import BlockSource
from ..formats.gguf_file import ggml_type
from ..formats.safetensors_index import MADV_POPULATE_READ
from .stream_repack import make_repacker
from .chunked_file import ChunkedFileWriter
from ..formats.views import close_mapping, map_file, typed_view

log = logging.getLogger("layerstream")

VERSION = 4  # bump when what an entry holds changes (the repack's bytes, the file's layout)
MARKER = "layerstream-prepacked.json"
DATA, DIGEST = "blocks.bin", "digest.json"
PAGE = 4096  # blocks start on a page: O_DIRECT reads and madvise ranges need it
ALIGN = 64  # every part starts on a cache line (and on its dtype's size)
SAMPLES, SAMPLE_BYTES = 16, 64 << 10
ROOM_MARGIN = 512 << 20  # free bytes left on the cache's file system after building an entry
MODES = ("auto", "off")
EXPERTS = "experts."  # a routed expert's weights: "experts.{e}.w_gate", ...
DTYPE_NAMES = {torch.uint8: "uint8", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def prepack_mode() -> str:
    """LAYERSTREAM_PREPACK: auto (the default: prepack where it applies) or off (repack at load and per step)."""
    mode = os.environ.get("LAYERSTREAM_PREPACK", "auto")
    if mode not in MODES:
        raise ValueError(f"LAYERSTREAM_PREPACK must be auto or off, got {mode!r}")
    return mode


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Part:
    offset: int  # from the block's start
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WeightLayout:
    name: str  # its name in the block's weights ("wqkv", "w_gate_up", "attn_norm", ...)
    kind: str  # "int4" | "int4s" | "int8" | "q4k" | "q6k" (VNNI layouts; parts: codes, scales) | "dense"
    shape: tuple[int, ...]  # logical: (out, in), or (n,)
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class BlockLayout:
    offset: int  # from the start of the blocks (page aligned)
    nbytes: int  # a whole number of pages: what mapping or reading the block moves
    weights: tuple[WeightLayout, ...]


@dataclass(frozen=True)
class PrepackedLayout:
    """Where every block's compute form lies in the entry's file, and where the entry lives."""

    dtype: torch.dtype  # the compute dtype
    blocks: tuple[BlockLayout, ...]
    folder: Path  # the cache entry (keyed by the source's identity)
    # The head (the tied token table where there is no lm_head) in its compute form, after the blocks:
    # made at every load it cost a repack of the largest matrix and its bytes in anonymous memory.
    head: BlockLayout | None = None

    @functools.cached_property
    def header(self) -> bytes:
        """The file's first bytes: length and JSON, unpadded."""
        def block(b: BlockLayout) -> dict:
            return {"offset": b.offset, "nbytes": b.nbytes,
                    "weights": [{"name": w.name, "kind": w.kind, "shape": list(w.shape),
                                 "parts": [[p.offset, DTYPE_NAMES[p.dtype], list(p.shape)] for p in w.parts]}
                                for w in b.weights]}

        doc = {"format": "layerstream-prepacked", "version": VERSION, "dtype": DTYPE_NAMES[self.dtype],
               "layout": kernel_layout(), "blocks": [block(b) for b in self.blocks],
               "head": block(self.head) if self.head is not None else None}
        raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return struct.pack("<Q", len(raw)) + raw

    @property
    def data_start(self) -> int:
        return _round_up(len(self.header), PAGE)

    @property
    def file_bytes(self) -> int:
        return self.data_start + sum(b.nbytes for b in self.blocks) + (self.head.nbytes if self.head else 0)

    @property
    def max_block_bytes(self) -> int:
        return max((b.nbytes for b in self.blocks), default=0)

    @functools.cached_property
    def expert_bytes(self) -> int:
        """The most bytes one routed expert's weights take in the entry (their parts): what the expert tier's fill
        of it maps or reads, and what the planner prices an expert at (0 for a dense model)."""
        per: dict[tuple[int, str], int] = {}
        for b, block in enumerate(self.blocks):
            for w in block.weights:
                if w.name.startswith(EXPERTS):
                    key = (b, w.name.split(".")[1])
                    per[key] = per.get(key, 0) + sum(p.nbytes for p in w.parts)
        return max(per.values(), default=0)

    @functools.cached_property
    def dense_bytes(self) -> int:
        """The most bytes a block's weights other than its routed experts take in the entry (their parts): what a
        block streamed without its experts maps."""
        return max((sum(p.nbytes for w in b.weights if not w.name.startswith(EXPERTS) for p in w.parts)
                    for b in self.blocks), default=0)


def _output_parts(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[tuple[torch.dtype, tuple], ...]:
    """(dtype, shape) of the parts StreamRepacker writes for one weight (its _write)."""
    if kind in ("dense", "bias"):
        return ((dtype, tuple(shape)),)
    return vnni_parts(kind, shape)


def prepack_layout(source: BlockSource, fmt: PackedFormat) -> tuple[PrepackedLayout | None, str | None]:
    """(the entry's layout, None) where this source's blocks come from a prepacked entry, else (None, why not)."""
    if prepack_mode() == "off":
        return None, "LAYERSTREAM_PREPACK=off"
    if not source.packed:
        return None, "the checkpoint is not packed (GGUF)"
    repacker = make_repacker(source, fmt)
    if repacker is None:
        return None, ("blocks are computed from the GGUF file's bytes in this mode (fp32 exact mode, a GPU, "
                      "a type the repack does not take such as MXFP4 experts, or no VNNI kernels / repack on this CPU)")
    blocks, offset = [], 0
    for b in range(source.num_blocks):
        outputs, kept = repacker.compute_form(b)
        infos = source.tensors(b)
        specs = []
        for o in outputs:
            kind = "dense" if o.kind == "bias" else o.kind
            if kind == "int4" and all(ggml_type(infos[p]) == GGMLQuantizationType.Q4_0 for p in o.parts):
                kind = "int4s"  # Q4_0's mins are -8 * its scales: stored without them, 10% fewer bytes to read
            specs.append((o.name, kind, o.shape, _output_parts(kind, o.shape, fmt.dtype)))
        for short in kept:
            t = infos[short]
            if t.quant is not None and len(t.shape) == 2:
                return None, f"{t.name} ({t.quant}, shape {list(t.shape)}) has no prepacked form"
            specs.append((short, "dense", t.shape, ((fmt.dtype, tuple(t.shape)),)))
        blocks.append(_place(offset, specs))
        offset += blocks[-1].nbytes
    head = _head_spec(source, fmt)
    key = hashlib.sha256("\0".join([checkpoint_identity(source.files), "prepacked", str(fmt.dtype),
                                    torch.__version__, kernel_layout(), str(VERSION)]).encode()).hexdigest()[:32]
    return PrepackedLayout(fmt.dtype, tuple(blocks), cache_root() / f"prepacked-v{VERSION}" / key,
                           _place(offset, [head]) if head is not None else None), None


def entry_available(layout: PrepackedLayout) -> bool:
    """The entry is built, or a load can build it: the nearest folder of it that exists is writable and its file
    system has the room _build asks for. Where it is not, a load computes from the GGUF file (_open_prepacked warns),
    so planning must not count on the entry (a GGUF's expert streaming does)."""
    if (layout.folder / MARKER).exists():
        return True
    at = layout.folder
    while not at.exists():
        at = at.parent
    try:
        return os.access(at, os.W_OK) and shutil.disk_usage(at).free >= layout.file_bytes + ROOM_MARGIN
    except OSError:
        return False


def _place(offset: int, specs) -> BlockLayout:
    """A block at `offset` holding `specs` ((name, kind, shape, parts' (dtype, shape)) each), every part
    on a cache line, the block a whole number of pages."""
    weights, at = [], 0
    for name, kind, shape, parts in specs:
        placed = []
        for dtype, part_shape in parts:
            at = _round_up(at, ALIGN)
            placed.append(Part(at, dtype, tuple(part_shape)))
            at += placed[-1].nbytes
        weights.append(WeightLayout(name, kind, tuple(shape), tuple(placed)))
    return BlockLayout(offset, _round_up(max(at, 1), PAGE), tuple(weights))


HEAD = "head"


def _head_spec(source: BlockSource, fmt: PackedFormat):
    """The head's (name, kind, shape, parts), as PackedFormat.resident makes it; None where that form
    is not one the kernels' layouts describe (it is then made at load, as before)."""
    infos = source.global_infos()
    t = infos.get("lm_head", infos["embed"])
    if t.quant is None:
        return HEAD, "dense", tuple(t.shape), ((fmt.dtype, tuple(t.shape)),)
    if len(t.shape) != 2 or t.shape[1] % 32:
        return None
    kind = kquant_layout(ggml_type(t), t.shape) or ("int4" if ggml_type(t) in INT4_TYPES else "int8")
    if ggml_type(t) == GGMLQuantizationType.Q4_0:
        kind = "int4s"
    return HEAD, kind, tuple(t.shape), _output_parts(kind, t.shape, fmt.dtype)


def _weights(block: BlockLayout, raw: torch.Tensor) -> dict[str, object]:
    out: dict[str, object] = {}
    for w in block.weights:
        parts = [typed_view(raw[p.offset:p.offset + p.nbytes], p.offset, p.dtype, p.shape) for p in w.parts]
        if w.kind in ("int4", "int4s"):  # int4s: scales only (the symmetric form)
            out[w.name] = Int4Weight(parts[0], parts[1], w.shape, "vnni")
        elif w.kind == "int8":
            out[w.name] = Int8Weight(parts[0], parts[1], w.shape, "vnni")
        elif w.kind in KQUANT_BYTES:
            out[w.name] = KQuantWeight(parts[0], parts[1], w.shape, w.kind)
        else:
            out[w.name] = parts[0]
    return out


def _parts_of(w) -> tuple[torch.Tensor, ...]:
    return (w.codes, w.scales) if isinstance(w, (Int4Weight, Int8Weight, KQuantWeight)) else (w,)


def _sample_digest(fd: int, start: int, end: int) -> str:
    """sha256 of SAMPLES pieces spread over [start, end): damage anywhere in a block shows up on
    some loads' checks only, but reading the whole file at every load would cost what mapping it saves."""
    h = hashlib.sha256()
    for i in range(SAMPLES):
        at = start + (end - start) * i // SAMPLES
        h.update(os.pread(fd, min(SAMPLE_BYTES, end - at), at))
    return h.hexdigest()


def _page_ranges(weights: tuple[WeightLayout, ...]) -> list[tuple[int, int]]:
    """[start, end) in their block of these weights' bytes, each weight's parts as one range (they lie back to back),
    starts rounded down to a page (madvise takes page-aligned starts; a block starts on a page), neighbours merged."""
    ranges = sorted((min(p.offset for p in w.parts) // PAGE * PAGE, max(p.offset + p.nbytes for p in w.parts))
                    for w in weights if w.parts)
    merged: list[list[int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


class PrepackedBlocks:
    """Every block of a GGUF file in its compute form, from the prepacked cache entry (built on the
    first load: `built` says this one did). Owns the entry's mapping until close(). OSError when
    the entry is missing and cannot be built (the cache is read-only or its disk full)."""

    def __init__(self, source: BlockSource, layout: PrepackedLayout,
                 on_progress: Callable[[int], None] | None = None, keep: Callable[[int, str], bool] | None = None):
        """source: the whole checkpoint's (the entry holds every block whole). keep(block, weight name): only the
        weights it accepts are handed out (a block's tensor groups on the device, or those off it: placement
        below the block), and a block moves only their bytes."""
        self.source, self.layout = source, layout
        self.folder, self.path = layout.folder, layout.folder / DATA
        self.built = False
        self._blocks = layout.blocks if keep is None else tuple(
            dataclasses.replace(b, weights=tuple(w for w in b.weights if keep(i, w.name)))
            for i, b in enumerate(layout.blocks))
        self._selected = keep is not None
        # A selection's page ranges in each block and the bytes it moves, made once: advise and nbytes run per
        # streamed block and step.
        self._ranges = [_page_ranges(b.weights) for b in self._blocks] if keep is not None else None
        self._selected_bytes = [sum(p.nbytes for w in b.weights for p in w.parts) for b in self._blocks] \
            if keep is not None else None
        self._experts: dict[tuple[int, int], tuple[BlockLayout, list[tuple[int, int]]]] = {}
        self._fd, self._map, self._base = -1, None, None
        self._open(on_progress)

    # -- building and checking the entry ---------------------------------------------------------
    def _open(self, on_progress) -> None:
        info = {"version": VERSION, "dtype": DTYPE_NAMES[self.layout.dtype], "layout": kernel_layout(),
                "source": [str(p) for p in self.source.files]}
        for attempt in (1, 2):
            build_once(self.folder, MARKER, info, lambda tmp: self._build(tmp, on_progress))
            try:
                self._map_checked()
                return
            except (OSError, ValueError, KeyError, CheckpointError) as e:
                self._unmap()
                if attempt == 2:
                    raise CheckpointError(f"{self.folder}: the prepacked cache entry just built is unusable: "
                                          f"{e}") from e
                log.warning("%s: prepacked cache entry is stale or damaged (%s); building it again", self.folder, e)
                shutil.rmtree(self.folder, ignore_errors=True)

    def _build(self, tmp: Path, on_progress) -> None:
        layout = self.layout
        tmp.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(tmp).free
        if free < layout.file_bytes + ROOM_MARGIN:
            raise OSError(errno.ENOSPC, f"{layout.file_bytes >> 20} MiB needed for the prepacked entry, "
                                        f"{free >> 20} MiB free", str(tmp))
        repacker = make_repacker(self.source, PackedFormat(layout.dtype))
        assert repacker is not None, "prepack_layout made a layout where there is no repack"
        log.info("prepacking %d GGUF blocks for the %s kernels, once (cached in %s)", len(layout.blocks),
                 kernel_layout(), self.folder)
        with open(tmp / DATA, "wb") as f:
            f.truncate(layout.file_bytes)
            out = ChunkedFileWriter(f.fileno())
            out.write(0, np.frombuffer(layout.header, dtype=np.uint8))
            for b, block in enumerate(layout.blocks):
                weights, slot = repacker.fill(b, self.source.stored_rows(b))
                try:
                    self._write(out, block, weights)
                finally:
                    repacker.give(slot)
                # Its GGUF bytes are not read again (later loads map the entry): out of this process.
                self.source.advise(b, mmap.MADV_DONTNEED)
                if on_progress:
                    on_progress(b)
            if layout.head is not None:
                infos = self.source.global_infos()
                name = "lm_head" if "lm_head" in infos else "embed"
                head = PackedFormat(layout.dtype).resident(infos[name], self.source.global_rows(name))
                self._write(out, layout.head, {HEAD: head})
            out.flush()
            os.fsync(f.fileno())
        fd = os.open(tmp / DATA, os.O_RDONLY)
        try:
            samples = _sample_digest(fd, layout.data_start, layout.file_bytes)
        finally:
            os.close(fd)
        (tmp / DIGEST).write_text(json.dumps({"size": layout.file_bytes, "sample_sha256": samples,
                                              "header_sha256": hashlib.sha256(layout.header).hexdigest()}))
        self.built = True

    def _write(self, out: ChunkedFileWriter, block: BlockLayout, weights: dict[str, object]) -> None:
        assert weights.keys() == {w.name for w in block.weights}, sorted(weights)
        for w in block.weights:
            weight = weights[w.name]
            if w.kind == "int4s":
                weight = weight.without_min()
                assert weight.scales.dim() == 3, f"{w.name}: Q4_0 repacked with mins other than -8 * scale"
            for part, t in zip(w.parts, _parts_of(weight), strict=True):
                assert t.dtype == part.dtype and tuple(t.shape) == part.shape, (w.name, t.shape, part)
                out.write(self.layout.data_start + block.offset + part.offset,
                          t.contiguous().reshape(-1).view(torch.uint8).numpy())

    def _map_checked(self) -> None:
        layout = self.layout
        digest = json.loads((self.folder / DIGEST).read_text())
        self._fd = os.open(self.path, os.O_RDONLY)
        size = os.fstat(self._fd).st_size
        if size != digest["size"] or size != layout.file_bytes:
            raise CheckpointError(f"{self.path} is {size} bytes, expected {layout.file_bytes} (truncated or replaced)")
        header = os.pread(self._fd, len(layout.header), 0)
        if hashlib.sha256(header).hexdigest() != digest["header_sha256"]:
            raise CheckpointError(f"{self.path}: header does not match {DIGEST} (overwritten)")
        if header != layout.header:
            raise CheckpointError(f"{self.path}: header is not this version's layout of the source")
        if _sample_digest(self._fd, layout.data_start, layout.file_bytes) != digest["sample_sha256"]:
            raise CheckpointError(f"{self.path}: sampled block bytes do not match {DIGEST} (overwritten)")
        self._map = map_file(self._fd)
        self._base = torch.frombuffer(self._map, dtype=torch.uint8)  # (file_bytes,)

    # -- the blocks ------------------------------------------------------------------------------
    def _span(self, block: int | None) -> tuple[int, int]:
        """[start, end) in the file of block `block`, or of the head (None)."""
        b = self.layout.blocks[block] if block is not None else self.layout.head
        start = self.layout.data_start + b.offset
        return start, start + b.nbytes

    @property
    def selected(self) -> bool:
        """Whether only some weights of each block are handed out (keep)."""
        return self._selected

    def nbytes(self, block: int) -> int:
        """What mapping or reading block `block` moves: whole pages, or a selection's (keep) weights' bytes."""
        return self._selected_bytes[block] if self._selected else self.layout.blocks[block].nbytes

    def raw(self, block: int) -> torch.Tensor:
        """Block `block`'s bytes, (nbytes,) uint8 over the mapping: zero-copy, nothing read yet."""
        start, end = self._span(block)
        return self._base[start:end]

    def weights(self, block: int, raw: torch.Tensor) -> dict[str, object]:
        """Block `block`'s weights in their compute form over `raw`, its bytes ((nbytes,) uint8: the
        mapping's, or a disk read's staging buffer), zero-copy."""
        return _weights(self._blocks[block], raw)

    def head(self, copy: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """The head in its compute form as zero-copy views of the mapped entry (faulted in now), or of
        copy(its bytes) ((nbytes,) uint8 -> the same bytes elsewhere); None where the entry holds none."""
        if self.layout.head is None:
            return None
        self.advise(None, MADV_POPULATE_READ)
        start, end = self._span(None)
        raw = self._base[start:end]
        if copy is not None:
            raw = copy(raw)
            self.advise(None, mmap.MADV_DONTNEED)
        return _weights(self.layout.head, raw)[HEAD]

    def expert(self, block: int, expert: int) -> dict[str, object]:
        """Routed expert `expert` of block `block` ({"w_gate", "w_up", "w_down"}: its weights in the kernels' form) as
        zero-copy views of the mapped entry, its pages faulted in now, whatever keep selected: the expert tier's
        page-cache fill (experts/tier.py ExpertReader.forms)."""
        prefix = f"{EXPERTS}{expert}."
        if (block, expert) not in self._experts:  # its weights' layout and pages, found once
            block_layout = self.layout.blocks[block]
            mine = dataclasses.replace(block_layout, weights=tuple(w for w in block_layout.weights
                                                                  if w.name.startswith(prefix)))
            self._experts[block, expert] = mine, _page_ranges(mine.weights)
        mine, ranges = self._experts[block, expert]
        self._advise_ranges(block, ranges, MADV_POPULATE_READ)
        return {name[len(prefix):]: w for name, w in _weights(mine, self.raw(block)).items()}

    def mapped(self, block: int) -> dict[str, object]:
        """Block `block`'s weights as zero-copy views of the mapped entry."""
        return self.weights(block, self.raw(block))

    def read_info(self, block: int) -> TensorInfo:
        """Block `block` as one byte range of the entry's file, for the disk tier's reader."""
        start, end = self._span(block)
        return TensorInfo(f"prepacked block {block}", self.path, torch.uint8, (end - start,), start, end)

    def advise(self, block: int | None, advice: int) -> None:
        """madvise block `block`'s pages, or the head's (None): MADV_POPULATE_READ ahead of use,
        MADV_DONTNEED after. With a selection (keep), only its weights' pages: a block streamed without its
        routed experts does not fault them in."""
        if self._selected and block is not None:
            self._advise_ranges(block, self._ranges[block], advice)
            return
        start, end = self._span(block)
        self._madvise(advice, start, end)

    def _advise_ranges(self, block: int, ranges: list[tuple[int, int]], advice: int) -> None:
        """madvise page ranges of block `block` (_page_ranges')."""
        base = self._span(block)[0]
        for start, end in ranges:
            self._madvise(advice, base + start, base + end)

    def _madvise(self, advice: int, start: int, end: int) -> None:
        try:
            self._map.madvise(advice, start, end - start)
        except (OSError, ValueError):
            pass  # an older kernel without POPULATE_READ: pages fault in on use instead

    def _unmap(self) -> None:
        self._base = None
        close_mapping(self._map, self._fd)
        self._map, self._fd = None, -1

    def close(self) -> None:
        self._unmap()
