"""The disk's sequential read bandwidth, measured on the model's own files.

The disk tier's floor is (bytes read from disk per step) / (this bandwidth); the plan prints it
and the benchmark reports how close a run gets. The measurement is a short read with the same
reader the disk tier uses (O_DIRECT, same request size and depth), so it bypasses the page cache
and measures the device, not memory. The result is cached per file system (its device number)
in the layerstream cache folder, so start-up pays for it once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .disk_reader import ALIGN, CHUNK_BYTES, DiskReader, ReadPlan, StagingBuffer, Span

log = logging.getLogger("layerstream")

CACHE_FILE = "disk-bandwidth.json"
CACHE_TTL_S = 7 * 24 * 3600
MEASURE_BYTES = 512 << 20  # enough for the device's queue to reach steady state
MEASURE_SECONDS = 2.0  # ...but stop early on a slow disk
MEASURE_PASSES = 4
MIN_CACHED_BYTES = 64 << 20  # a read shorter than this (a tiny model) says little about the disk


@dataclass
class DiskBandwidth:
    gbps: float  # 1e9 bytes per second
    bytes_read: int
    seconds: float
    direct: bool  # O_DIRECT (device speed); False: buffered with the pages dropped first
    file: str
    measured_at: float
    cached: bool = False

    def describe(self) -> str:
        how = "O_DIRECT" if self.direct else "buffered"
        src = "cached" if self.cached else "measured"
        return f"{self.gbps:.2f} GB/s (best part of a {how} sequential read of {self.bytes_read / 1e6:.0f} MB, {src})"


def filesystem_key(path: str | os.PathLike) -> str:
    st = os.stat(path)
    return f"dev-{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _cache_path() -> Path:
    from ...cache import cache_root

    return cache_root() / CACHE_FILE


def _load_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(key: str, bw: DiskBandwidth) -> None:
    path = _cache_path()
    data = _load_cache()
    rec = asdict(bw)
    rec.pop("cached")
    data[key] = rec
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as e:
        log.warning("cannot cache the disk bandwidth in %s: %s", path, e)


def measure(path: str | os.PathLike, max_bytes: int = MEASURE_BYTES, max_seconds: float = MEASURE_SECONDS,
            direct: bool = True, passes: int = MEASURE_PASSES) -> DiskBandwidth:
    """Read up to max_bytes of `path` sequentially (from its middle, past any header) in `passes`
    consecutive parts timed separately; the fastest part is the figure. Other processes' I/O can
    only slow a part down, so the best one is the closest to what the disk itself can do."""
    path = Path(path)
    size = os.stat(path).st_size
    length = min(max_bytes, size - size % ALIGN)
    if length < ALIGN:
        raise ValueError(f"{path}: {size} bytes is too small to measure a disk's bandwidth on")
    start = ((size - length) // 2) // ALIGN * ALIGN
    per_pass = max(ALIGN, length // passes // ALIGN * ALIGN)
    reader = DiskReader([path], direct=direct)
    try:
        if not reader.direct and hasattr(os, "posix_fadvise"):
            # Buffered: drop the file's cached pages so the read reaches the disk.
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        # Several requests at a time, like the disk tier, over a buffer of a few chunks reused
        # round-robin: the bytes are discarded, only the time matters.
        group = CHUNK_BYTES * reader.in_flight
        buf = StagingBuffer(group)
        done, best, t_start = 0, 0.0, time.perf_counter()
        while done + per_pass <= length and time.perf_counter() - t_start < max_seconds:
            t0, pass_end = time.perf_counter(), done + per_pass
            while done < pass_end:
                n = min(group, pass_end - done)
                done += reader.read(ReadPlan((Span(path, start + done, start + done + n, 0),), {}, n), buf)
            best = max(best, per_pass / (time.perf_counter() - t0))
        seconds = time.perf_counter() - t_start
        direct_used = reader.direct
    finally:
        reader.close()
    return DiskBandwidth(best / 1e9, done, seconds, direct_used, str(path), time.time())


def disk_bandwidth(paths, use_cache: bool = True, max_bytes: int = MEASURE_BYTES,
                   max_seconds: float = MEASURE_SECONDS, passes: int = MEASURE_PASSES) -> DiskBandwidth:
    """Bandwidth of the file system holding `paths` (measured on the largest), cached per file system;
    use_cache=False measures again (and caches the new figure). passes=1 times one sustained read of
    max_bytes (what reading a whole model each step can keep up) rather than the fastest of parts."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("no files to measure the disk bandwidth on")
    largest = max(paths, key=lambda p: os.stat(p).st_size)
    key = filesystem_key(largest)
    if use_cache:
        rec = _load_cache().get(key)
        if isinstance(rec, dict) and time.time() - rec.get("measured_at", 0) < CACHE_TTL_S:
            try:
                return DiskBandwidth(**rec, cached=True)
            except TypeError:
                pass  # a record from another version: measure again
    bw = measure(largest, max_bytes, max_seconds, passes=passes)
    log.info("disk bandwidth of %s: %s", key, bw.describe())
    if bw.bytes_read >= MIN_CACHED_BYTES:
        _store(key, bw)
    return bw
