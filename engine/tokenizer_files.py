"""Tokenizer folders the engine writes (the demo model's; a GGUF file's metadata folder; the benchmarks'
models): what transformers saves, plus `added_tokens_decoder` in tokenizer_config.json where transformers left
it out. Without it, every load reads the whole tokenizer.json once more in Python to find the added tokens,
which takes about as long as the Rust tokenizer's own parse of it (a tenth of a second for a 49k-token
vocabulary): most of a small model's start-up once its weights are mapped."""

from __future__ import annotations

import json
from pathlib import Path


def save_tokenizer(tok, folder: str | Path) -> None:
    """tok.save_pretrained(folder), with the added tokens recorded in tokenizer_config.json."""
    tok.save_pretrained(folder)
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if "added_tokens_decoder" not in config:
        config["added_tokens_decoder"] = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(tok.added_tokens_decoder.items())}
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
