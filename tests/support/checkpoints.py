"""Editing a safetensors file's header in place, to make the bad checkpoints the error tests need."""

from __future__ import annotations

import json
import struct
from contextlib import contextmanager


def read_header(path):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


@contextmanager
def edited_header(path):
    """Yields the file's JSON header to change; writes it back in front of the same data."""
    header, data = read_header(path)
    yield header
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
