"""Which reader opens a checkpoint: the one place checkpoint formats are told apart."""

from __future__ import annotations

from pathlib import Path

from ..errors import CheckpointError
from .checkpoint import CheckpointReader
from .safetensors_index import WeightIndex


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """The reader for the checkpoint at `path` (a safetensors folder today; a .gguf file next)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        raise CheckpointError(f"{path}: GGUF checkpoints are not supported yet (safetensors folders are)")
    return WeightIndex(path)
