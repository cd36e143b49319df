"""Tokenizer folders the engine writes (engine/tokenizer_files.py): the added tokens recorded in
tokenizer_config.json, so that a load does not parse tokenizer.json once more in Python, and a tokenizer
that behaves exactly as the one transformers' own save_pretrained gives."""

from __future__ import annotations

import json

from engine.demo import train_tokenizer
from engine.llm_engine import load_tokenizer
from engine.tokenizer_files import save_tokenizer

TEXT = "<|begin|>Hello world! café 日本語<|endoftext|> def main(): return 0"


def test_a_saved_tokenizer_loads_without_reading_tokenizer_json_in_python(tmp_path, monkeypatch):
    tok = train_tokenizer(tmp_path / "trained")
    save_tokenizer(tok, tmp_path / "ours")
    tok.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "ours" / "tokenizer_config.json").read_text())
    assert {v["content"] for v in config["added_tokens_decoder"].values()} == set(tok.added_tokens_encoder)

    opened = []
    real = json.load

    def spy(f, *a, **kw):
        opened.append(getattr(f, "name", ""))
        return real(f, *a, **kw)

    monkeypatch.setattr(json, "load", spy)
    ours = load_tokenizer(tmp_path / "ours")
    assert not [n for n in opened if n.endswith("tokenizer.json")], opened
    plain = load_tokenizer(tmp_path / "plain")
    assert [n for n in opened if n.endswith("tokenizer.json")]  # what the record saves: transformers' own read

    messages = [{"role": "user", "content": "Hi there"}]
    for a, b in ((ours, plain), (ours, tok)):
        assert a.encode(TEXT) == b.encode(TEXT)
        assert a.added_tokens_decoder == b.added_tokens_decoder
        assert (a.bos_token_id, a.eos_token_id, a.pad_token_id) == (b.bos_token_id, b.eos_token_id, b.pad_token_id)
        assert a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
            b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert a.decode(a.encode(TEXT)) == b.decode(b.encode(TEXT))
