"""Incremental detokenisation: never a broken UTF-8 character, deltas add up to the full decode."""

import pytest

from engine.demo import train_tokenizer
from engine.detokenizer import IncrementalDetokenizer

TEXT = "Hello 🙂🚀 café naïve 日本語 — “quotes” über straße ✨ end"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"))


def run(tok, ids, prompt=(), stop=None):
    d = IncrementalDetokenizer(tok, list(prompt), stop)
    deltas = []
    for i, t in enumerate(ids):
        d.add_token(t)
        deltas.append(d.take_delta(final=False))
        if d.stopped:
            break
    d.flush()
    deltas.append(d.take_delta(final=True))
    return deltas, d


def test_multibyte_characters_split_across_tokens_are_held_back(tok):
    ids = tok.encode(TEXT)
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces), "the test text must split a character across tokens"
    deltas, _ = run(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == TEXT


def test_prompt_context_does_not_leak_into_output(tok):
    prompt = tok.encode("Once upon a time")
    ids = tok.encode(" there was a model")
    deltas, _ = run(tok, ids, prompt)
    assert "".join(deltas) == " there was a model"


@pytest.mark.parametrize("stop", ["café", "🚀", "x never appears x"])
def test_stop_strings_are_cut_and_held_back(tok, stop):
    ids = tok.encode(TEXT)
    deltas, d = run(tok, ids, stop=[stop])
    text = "".join(deltas)
    if stop in TEXT:
        assert d.stopped and text == TEXT[:TEXT.index(stop)]
        # no delta ever showed a prefix of the stop string that later had to be taken back
        assert stop not in text
    else:
        assert not d.stopped and text == TEXT
