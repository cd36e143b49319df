"""Typed tensors over raw bytes without copying: the one helper every reader and staging buffer uses;
and closing the file mappings they view."""

from __future__ import annotations

import math
import mmap
import os

import torch


def typed_view(raw: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """`raw` ((nbytes,) uint8) seen as a `dtype` tensor of `shape`, zero-copy. `offset` is where raw
    starts in its allocation: bytes not aligned to the dtype's size cannot be viewed as it, so those
    (rare, only hand-made files) are copied, the one correct option."""
    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    if offset % dtype.itemsize:
        return raw.clone().view(dtype).reshape(shape)
    return raw.view(dtype).reshape(shape)


def row_shape(shape: tuple[int, ...], nbytes: int) -> tuple[int, ...]:
    """The shape of a tensor's `nbytes` stored bytes as rows: (rows..., bytes per row) for its logical
    `shape` (a packed GGML row is a run of whole blocks, so rows stay independent)."""
    if len(shape) < 2:
        return (nbytes,)
    rows = math.prod(shape[:-1])
    return (*shape[:-1], nbytes // rows if rows else 0)


def byte_rows(raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's (nbytes,) uint8 bytes viewed as row_shape(shape), zero-copy."""
    return raw.view(row_shape(shape, raw.numel()))


def close_mapping(mapping: mmap.mmap | None, fd: int) -> None:
    """Unmap a file mapping and close its descriptor (either may be absent: None, -1). Tensors that
    still view the mapping keep it alive: it is unmapped when they are collected."""
    if mapping is not None:
        try:
            mapping.close()
        except BufferError:
            pass  # exported views remain; the mapping goes with the last of them
    if fd >= 0:
        os.close(fd)
