"""The KV disk tier: full prefix-cache blocks kept in files, found again by their block hashes, across
restarts. No torch: a block is the bytes engine.kv_cache.KVCache.block_bytes gives (every layer's K and
V, quantized when the cache is), and the block manager decides what to write and what to look up.

- One file per block, named by its content address (engine.block_manager.block_hash, chained over the
  whole prefix), under a folder per model identity. The file carries a header: magic, format version,
  the model identity's digest, the payload's length and its BLAKE2b digest. A file whose header or
  digest does not match (another model, another KV format, a torn or damaged write) is a miss, deleted,
  never wrong KV: it is verified before the block manager counts it as a hit.
- Written through: a block is written once, when it is first published to the prefix cache, so a
  restart (or a crash) finds every full block computed before it. Writes run on a writer thread from a
  snapshot of the block's bytes (atomically: a temporary file renamed into place); the compute thread
  only copies the bytes.
- Capped at capacity_bytes: least recently used files go first (use is the file's mtime, so the order
  survives a restart).
- Reads overlap compute: a request's blocks are read by reader threads from the moment it is queued
  (prefetch), while the running steps compute; admission then finds them read and verified (load), and
  the KV cache copies them into the pool before the next pass.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("layerstream")

FORMAT_VERSION = 1
MAGIC = b"LSKVBLK\0"
_HEADER = struct.Struct("<8sI32sQ32s")  # magic, version, identity digest, payload bytes, payload digest
SUFFIX = ".kvb"


def identity_digest(identity: dict) -> bytes:
    """The 32-byte digest of a model identity (what must match for stored KV to be valid: the model's
    files, shapes, compute dtype, KV format, block size), with the format version."""
    text = json.dumps({"format": FORMAT_VERSION, **identity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).digest()


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=32).digest()


@dataclass
class DiskStats:
    """Counters since start (telemetry)."""

    blocks_written: int = 0
    blocks_read: int = 0  # verified and staged
    bad_files: int = 0  # a header, identity or digest mismatch, or a short file: a miss
    bytes_written: int = 0
    bytes_read: int = 0


class KVDiskTier:
    def __init__(self, folder: str | os.PathLike, capacity_bytes: int, identity: dict, block_nbytes: int,
                 stage_bytes: int = 512 << 20, readers: int = 2):
        if capacity_bytes <= 0:
            raise ValueError(f"the KV disk tier needs capacity_bytes > 0, got {capacity_bytes}")
        self.identity = identity_digest(identity)
        self.folder = Path(folder) / self.identity.hex()[:16]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_nbytes = block_nbytes
        self.file_bytes = _HEADER.size + block_nbytes
        self.capacity_blocks = max(1, capacity_bytes // self.file_bytes)
        self.stats = DiskStats()
        self._lock = threading.Lock()
        # key -> None, least recently used first: the files on disk (and those being written).
        self._index: OrderedDict[bytes, None] = OrderedDict()
        for path in sorted(self.folder.glob("*" + SUFFIX), key=_mtime):
            try:
                self._index[bytes.fromhex(path.stem)] = None
            except ValueError:
                continue  # not one of ours
        self._pending: dict[bytes, bytes] = {}  # written soon: served from memory meanwhile
        self._reads: OrderedDict[bytes, Future] = OrderedDict()  # key -> Future[bytes | None], staged or in flight
        self._stage_blocks = max(1, stage_bytes // max(1, block_nbytes))
        self._pool = ThreadPoolExecutor(readers, thread_name_prefix="layerstream-kv-disk-read")
        self._writes: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="layerstream-kv-disk-write", daemon=True)
        self._writer.start()
        self._evict_over_capacity()

    # -- what the block manager calls (no I/O on its thread but starting reads) -------------------------
    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def prefetch(self, keys: list[bytes]) -> None:
        """Start reading the leading keys that are on disk, in the background (a request was queued)."""
        for key in keys:
            if not self.contains(key):
                break
            self._read_async(key)

    def load(self, keys: list[bytes]) -> int:
        """How many leading keys are on disk with a verified file, now staged in memory for take(); waits for
        their reads (started here, or earlier by prefetch). A damaged file ends the run and is deleted."""
        futures = []
        for key in keys[:self._stage_blocks]:
            if not self.contains(key):
                break
            futures.append(self._read_async(key))
        found = 0
        for future in futures:
            if future.result() is None:
                break
            found += 1
        return found

    def take(self, key: bytes) -> bytes | None:
        """The staged payload of a key load() counted (and forget it), or None."""
        with self._lock:
            future = self._reads.pop(key, None)
        return None if future is None else future.result()

    def put(self, key: bytes, payload: bytes) -> None:
        """Write a block (a snapshot of its bytes) unless it is on disk already; returns at once."""
        assert len(payload) == self.block_nbytes, (len(payload), self.block_nbytes)
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return
            self._index[key] = None
            self._pending[key] = payload
        self._writes.put(key)
        self._evict_over_capacity()

    def close(self) -> None:
        """Finish the queued writes, then stop the threads."""
        self._writes.put(None)
        self._writer.join()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- internals -----------------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def _read_async(self, key: bytes) -> Future:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)  # used: evicted last
            future = self._reads.get(key)
            if future is not None:
                self._reads.move_to_end(key)
                return future
            pending = self._pending.get(key)
            if pending is not None:
                future = Future()
                future.set_result(pending)
            else:
                future = self._pool.submit(self._read, key)
            self._reads[key] = future
            while len(self._reads) > self._stage_blocks:  # staged reads nobody took: dropped, oldest first
                self._reads.popitem(last=False)
            return future

    def _read(self, key: bytes) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                data = f.read(self.file_bytes + 1)
        except OSError:
            data = b""
        payload = self._verify(data)
        if payload is None:
            log.warning("KV disk tier: %s is damaged or of another model or format; treated as a miss and removed",
                        path.name)
            with self._lock:
                self.stats.bad_files += 1
                self._index.pop(key, None)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used: evicted last, across restarts too
        except OSError:
            pass
        with self._lock:
            self.stats.blocks_read += 1
            self.stats.bytes_read += len(data)
            if key in self._index:
                self._index.move_to_end(key)
        return payload

    def _verify(self, data: bytes) -> bytes | None:
        if len(data) != self.file_bytes:
            return None
        magic, version, identity, length, digest = _HEADER.unpack_from(data)
        payload = memoryview(data)[_HEADER.size:]
        if (magic != MAGIC or version != FORMAT_VERSION or identity != self.identity or length != self.block_nbytes
                or _digest(payload) != digest):
            return None
        return bytes(payload)

    def _write_loop(self) -> None:
        while (key := self._writes.get()) is not None:
            with self._lock:
                payload = self._pending.get(key)
            if payload is None:
                continue  # evicted before it was written
            path = self._path(key)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, self.identity, len(payload), _digest(payload)))
                    f.write(payload)
                os.replace(tmp, path)
                with self._lock:
                    self.stats.blocks_written += 1
                    self.stats.bytes_written += self.file_bytes
            except OSError as e:
                log.warning("KV disk tier: could not write %s (%s); that block stays in memory only", path.name, e)
                tmp.unlink(missing_ok=True)
                with self._lock:
                    self._index.pop(key, None)
            finally:
                with self._lock:
                    self._pending.pop(key, None)

    def _evict_over_capacity(self) -> None:
        with self._lock:
            victims = []
            while len(self._index) > self.capacity_blocks:
                key, _ = self._index.popitem(last=False)
                self._pending.pop(key, None)
                victims.append(key)
        for key in victims:
            self._path(key).unlink(missing_ok=True)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
