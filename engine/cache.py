"""The layerstream cache folder, and the one way anything is built into it.

Everything layerstream derives from a model (GGUF metadata read by transformers, quantized blocks, the
demo and benchmark models, the disk's measured speed) lives under `cache_root()`, never beside the
user's model files.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable


def cache_root() -> Path:
    """$LAYERSTREAM_CACHE, else $XDG_CACHE_HOME/layerstream, else ~/.cache/layerstream."""
    base = os.environ.get("LAYERSTREAM_CACHE") or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "layerstream" if not os.environ.get("LAYERSTREAM_CACHE") else Path(base)


def build_once(folder: Path, marker: str, info: dict, build: Callable[[Path], None]) -> Path:
    """`folder`, made by `build(tmp)` the first time only. It is built in a temporary sibling, marked
    complete (`marker`, holding `info`) and renamed into place, so a half-built folder is never
    used; when two processes build at once, the second rename fails and both use the first's
    (identical) folder."""
    if (folder / marker).exists():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a build of this pid that died half-way
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        build(tmp)
        (tmp / marker).write_text(json.dumps(info))
        tmp.rename(folder)
    except OSError:
        if not (folder / marker).exists():
            raise
        # another process built it first; theirs is identical
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
