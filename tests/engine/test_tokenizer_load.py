"""The tokenizer a model loads with (engine.llm_engine.load_tokenizer) is the one transformers' AutoTokenizer
gives, loaded by the class its tokenizer_config.json names, without AutoTokenizer's detour through the model's
transformers config (whose import costs a fresh process more than mapping a model's weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from engine.demo import demo_gguf_path
from engine.llm_engine import load_tokenizer
from engine.weights import config_folder
from tests.support.gguf_models import Q, tiny_gguf
from tests.support.models import build

TEXTS = ["Hello world", "  spaces,\ttabs\nand lines\n\n", "ünïcödé 你好 🙂", "<|im_start|>user\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def _models(tmp_path: Path) -> list[Path]:
    # a GGUF whose named class (Qwen2Tokenizer) has an __init__ of its own, where load_tokenizer's generic
    # backend is not what AutoTokenizer gives; the demo's names the generic class already
    out = [build(tmp_path / "llama", "llama"), tiny_gguf(tmp_path, "qwen2", Q.Q8_0)]
    demo = demo_gguf_path()
    if demo is not None:
        out.append(demo)
    return out


def test_it_is_autotokenizers_tokenizer(tmp_path):
    """The same class as AutoTokenizer's for a model folder; for a GGUF file's metadata folder transformers'
    generic backend over the tokenizer.json the engine saved (no second parse in Python), which encodes,
    decodes and templates as AutoTokenizer's class does."""
    for model in _models(tmp_path):
        ours, theirs = load_tokenizer(model), AutoTokenizer.from_pretrained(config_folder(model))
        if model.suffix == ".gguf":
            assert type(ours) is PreTrainedTokenizerFast, (model, type(ours))
        else:
            assert type(ours) is type(theirs), model
        for text in TEXTS:
            assert ours.encode(text) == theirs.encode(text), (model, text)
            ids = theirs.encode(text)
            assert ours.decode(ids) == theirs.decode(ids)
        assert ours.all_special_ids == theirs.all_special_ids and ours.eos_token_id == theirs.eos_token_id
        if theirs.chat_template:
            assert (ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
                    == theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))


def test_it_does_not_import_the_models_transformers_config(tmp_path):
    model = build(tmp_path / "llama", "llama")
    code = ("import sys; from engine.llm_engine import load_tokenizer; "
            f"load_tokenizer({str(model)!r}); "
            "print([m for m in sys.modules if m.startswith('transformers.models.') and 'configuration' in m])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("config", [None, "{not json", json.dumps({"tokenizer_class": "NoSuchTokenizer"})])
def test_an_unnamed_or_unknown_class_takes_autotokenizer(tmp_path, config):
    model = build(tmp_path / "llama", "llama")
    path = model / "tokenizer_config.json"
    if config is None:
        data = json.loads(path.read_text())
        data.pop("tokenizer_class", None)
        path.write_text(json.dumps(data))
    else:
        path.write_text(config)
    if config == "{not json":  # AutoTokenizer's own error for a file it cannot read, not ours
        with pytest.raises(Exception) as theirs:
            AutoTokenizer.from_pretrained(model)
        with pytest.raises(type(theirs.value)):
            load_tokenizer(model)
        return
    assert load_tokenizer(model).encode(TEXTS[0]) == AutoTokenizer.from_pretrained(model).encode(TEXTS[0])
