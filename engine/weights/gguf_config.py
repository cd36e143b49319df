"""A GGUF file's config, tokenizer and chat template, read from its metadata through transformers
(`AutoConfig` / `AutoTokenizer.from_pretrained(folder, gguf_file=...)`) and cached."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..arch import ModelConfig, UnsupportedModelError, config_from_hf
from ..cache import build_once, cache_root

log = logging.getLogger("layerstream")

# transformers' model_type for the file -> the architecture the engine runs
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}


METADATA_VERSION = 2  # bump when what is saved changes: older folders are then left alone


def metadata_folder(path: Path, header_digest: str) -> Path:
    """A folder with the transformers config and tokenizer that the GGUF metadata describes.

    transformers reads them with gguf-py's GGUFReader, which takes seconds for a real vocabulary
    (40-130 s for SmolLM2 on a busy 2-core machine), twice (config, tokenizer). So the first load
    saves them under the layerstream cache, keyed by a hash of the file's header (metadata and
    tensor table: the same file anywhere hits the same entry), and later loads read that folder.
    Nothing is written beside the model file.
    """
    folder = cache_root() / f"gguf-metadata-v{METADATA_VERSION}" / f"{path.stem}-{header_digest[:20]}"

    def build(tmp: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        log.info("%s: reading config and tokenizer from the GGUF metadata (once; cached in %s)", path, folder)
        AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tmp)

    return build_once(folder, "layerstream-gguf-metadata.json", {"file": str(path), "header_sha256": header_digest},
                      build)


def load_gguf_config(path: Path, architecture: str, header_digest: str) -> ModelConfig:
    if architecture not in MODEL_TYPES:
        raise UnsupportedModelError(f"{path}: GGUF architecture {architecture!r} is not supported; supported: "
                                    f"{', '.join(sorted(MODEL_TYPES))}")
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(metadata_folder(path, header_digest))
    hf.architectures = [MODEL_TYPES.get(hf.model_type, MODEL_TYPES[architecture])]
    # GGUF holds packed blocks; the compute dtype is chosen by PackedFormat (bf16 unless float32).
    return config_from_hf(hf, hf.architectures[0], torch.bfloat16)
