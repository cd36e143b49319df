"""Checkpoint readers: one interface over every on-disk format, and the one place formats are told apart.

A reader is a validated index of named tensors. Each tensor is a byte range of one file, a logical shape,
and how those bytes are stored: a torch dtype for plain tensors (F32/F16/BF16), or a quant type such as
"Q4_K" for packed tensors that only a dequantizer can read. Plain tensors are handed out as zero-copy
views in their storage dtype; any tensor's bytes as a zero-copy uint8 view. A reader also knows its
format's tensor names (which tensor is block i's "wq", which the embedding table), so nothing outside
this package ever spells a checkpoint tensor name.

Adding a format is one class implementing CheckpointReader and one branch in `formats.open_checkpoint`
(safetensors_index.WeightIndex and gguf_file.GGUFIndex are the two today). A reader also reads its
format's model config (config.json beside safetensors, the metadata of a GGUF file).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...errors import CheckpointError

if TYPE_CHECKING:
    from ...arch import ModelConfig

__all__ = ["CheckpointError", "CheckpointReader", "TensorInfo", "split_stacked"]


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies in its file and how it is stored. Exactly one of dtype / quant is set."""

    name: str  # the checkpoint's own name for it
    path: Path
    dtype: torch.dtype | None  # storage dtype of a plain tensor; None for a packed one
    shape: tuple[int, ...]  # logical shape: what the model math sees (after dequantisation)
    start: int  # absolute byte offset in the file
    end: int
    quant: str | None = None  # quant type of a packed tensor, e.g. "Q4_K"

    @property
    def nbytes(self) -> int:
        """Bytes stored in the file (packed bytes for a quantised tensor)."""
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class CheckpointReader(ABC):
    """What every checkpoint format provides; see the module docstring. A reader keeps its validated
    index in `entries` (name -> TensorInfo) and its open files in `_files` (path -> an object with
    raw(entry), advise(start, end, advice) and close()); the lookups below are the same for every format."""

    folder: Path  # what the user named (a folder, or a single-file checkpoint)
    entries: dict[str, TensorInfo]
    _files: dict

    @property
    def files(self) -> list[Path]:
        """Every file holding tensors (the disk tier and the disk-speed probe read them directly)."""
        return list(self._files)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def names(self) -> list[str]:
        return list(self.entries)

    def tensor(self, name: str) -> TensorInfo:
        """The tensor's entry; CheckpointError if the checkpoint has no such tensor."""
        try:
            return self.entries[name]
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} is missing from the checkpoint") from None

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's stored bytes as a zero-copy (nbytes,) uint8 view (packed tensors are read so)."""
        t = self.tensor(name)
        return self._files[t.path].raw(t)

    @abstractmethod
    def view(self, name: str) -> torch.Tensor:
        """A plain tensor as a zero-copy view of the mapped file, in its storage dtype and logical shape."""

    def advise(self, names: list[str], advice: int) -> None:
        """madvise the mapped pages of these tensors (MADV_POPULATE_READ, MADV_DONTNEED)."""
        for name in names:
            t = self.entries[name]
            self._files[t.path].advise(t.start, t.end, advice)

    @abstractmethod
    def block_tensor_name(self, layer: int, short: str) -> str:
        """This format's name for a block tensor the model math calls `short` (arch.BLOCK_WEIGHTS)."""

    @abstractmethod
    def global_tensor_name(self, short: str) -> str:
        """This format's name for "embed", "norm" or "lm_head"."""

    @abstractmethod
    def model_config(self) -> "ModelConfig":
        """The architecture and shapes this checkpoint's format records for it."""

    def row_order(self, name: str) -> torch.Tensor | None:
        """Rows to gather from the stored tensor to get the engine's row order, (rows,) int64, or None
        when it is stored in that order (every format but llama-family GGUF's Q and K)."""
        return None

    def total_bytes(self) -> int:
        """Bytes of every tensor in the checkpoint."""
        return sum(t.nbytes for t in self.entries.values())

    def close(self) -> None:
        """Close every file; closing again does nothing."""
        for f in self._files.values():
            f.close()
        self._files = {}


def split_stacked(entries: dict[str, TensorInfo], suffixes: tuple[str, ...]) -> dict[str, TensorInfo]:
    """entries with each tensor whose name ends with ".<suffix>" and that stacks experts along its first
    dimension (GPT-OSS's safetensors, llama.cpp's *_exps tensors) replaced by one entry per expert,
    "<name>[e]", its byte range the e-th slice (whole rows, so whole GGML blocks too); every other entry as it
    was. Each expert then streams, and is checked, as a tensor of its own."""
    dotted = tuple("." + s for s in suffixes)
    out: dict[str, TensorInfo] = {}
    for name, info in entries.items():
        if not name.endswith(dotted) or len(info.shape) < 2:
            out[name] = info
            continue
        experts, step = info.shape[0], info.nbytes // max(1, info.shape[0])
        for e in range(experts):
            out[f"{name}[{e}]"] = TensorInfo(f"{name}[{e}]", info.path, info.dtype, info.shape[1:],
                                             info.start + e * step, info.start + (e + 1) * step, info.quant)
    return out
