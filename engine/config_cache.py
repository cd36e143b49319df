"""ModelConfigs made once per model config and kept under the layerstream cache.

Making a ModelConfig goes through transformers' config classes (their defaults, derived fields and
validation: engine.arch.config_from_hf), and importing those costs a fresh process more than the rest
of loading a mapped model. So the result is pickled under the cache, keyed by the bytes it was made
from (config.json, or a GGUF file's header digest), the engine code that turns them into a ModelConfig
and the transformers release, and later loads read it back. A missing, damaged or foreign entry is a
miss: the config is made again (and the entry rewritten), never guessed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import pickle
from pathlib import Path
from typing import Callable, TypeVar

from .cache import cache_root

log = logging.getLogger("layerstream")

VERSION = 1
# The code that derives a ModelConfig from its source: an edit to any of these is another key.
_DERIVING = (Path(__file__).with_name("arch.py"), Path(__file__).parent / "weights" / "formats" / "gguf_config.py")


def _code_digest() -> bytes:
    h = hashlib.sha256()
    for path in _DERIVING:
        h.update(path.read_bytes())
    try:
        h.update(importlib.metadata.version("transformers").encode())
    except importlib.metadata.PackageNotFoundError:
        pass
    return h.digest()


Config = TypeVar("Config")


def cached_model_config(source: bytes, make: Callable[[], Config], kind: type[Config]) -> Config:
    """The config (a `kind`, engine.arch.ModelConfig) that make() returns for `source` (the bytes it is
    made from), read from the cache when an earlier load made it."""
    key = hashlib.sha256(source + _code_digest()).hexdigest()[:32]
    path = cache_root() / f"model-config-v{VERSION}" / f"{key}.pickle"
    try:
        cfg = pickle.loads(path.read_bytes())
        if isinstance(cfg, kind):
            return cfg
    except FileNotFoundError:
        pass
    except Exception as e:  # damaged or from an incompatible build: make it again
        log.info("model config cache entry %s unreadable (%s): making it again", path, e)
    cfg = make()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        tmp.write_bytes(pickle.dumps(cfg))
        tmp.replace(path)  # atomic: a reader sees the old entry, none, or this one whole
    except OSError as e:  # a read-only cache: every load makes the config
        log.info("model config not cached (%s)", e)
    return cfg
