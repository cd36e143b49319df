"""Which reader opens a checkpoint: the one place checkpoint formats are told apart."""

from __future__ import annotations

from pathlib import Path

from .reader import CheckpointReader
from .gguf_file import GGUFIndex
from .safetensors_index import WeightIndex


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def open_checkpoint(path: str | Path) -> CheckpointReader:
    """The reader for the checkpoint at `path`: a .gguf file (the first of a split set), or a
    safetensors folder."""
    path = Path(path)
    if is_gguf(path):
        return GGUFIndex(path)
    return WeightIndex(path)


def config_folder(path: str | Path) -> Path:
    """The folder transformers reads the model's config, tokenizer and chat template from: the model
    folder itself, or for a GGUF file the cached folder its metadata was saved to."""
    path = Path(path)
    if not is_gguf(path):
        return path
    from .gguf_config import metadata_folder
    from .gguf_file import GGUFIndex

    index = GGUFIndex(path)  # every split: an architecture read by layerstream needs all tensor names
    try:
        digest, metadata, names = index.header_digest, index.metadata, frozenset(index.entries)
    finally:
        index.close()
    return metadata_folder(path, digest, metadata.get("general.architecture"), metadata, names)


def is_gguf_metadata_folder(folder: str | Path) -> bool:
    """Whether `folder` is one config_folder made for a GGUF file (its config and tokenizer the engine saved)."""
    from .gguf_config import METADATA_MARKER

    return (Path(folder) / METADATA_MARKER).is_file()
