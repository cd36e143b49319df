"""Typed tensors over raw bytes without copying: the one helper every reader and staging buffer uses."""

from __future__ import annotations

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


def byte_rows(raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's (nbytes,) uint8 bytes as (rows..., bytes per row) for its logical `shape`, zero-copy
    (a packed GGML row is a run of whole blocks, so rows stay independent)."""
    return raw.view(*shape[:-1], -1) if len(shape) > 1 and raw.numel() else raw
