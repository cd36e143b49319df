"""Training data: chat rendering with the loss on assistant turns only, text, cuts, packing, shuffling,
and a clear error naming the line for each kind of bad line."""

import json

import pytest
from transformers import AutoTokenizer

from engine.finetune import TrainConfig
from engine.finetune.data import DataError, epoch_steps, load_jsonl

CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
                     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"},
                     {"role": "assistant", "content": "See you."}]}


@pytest.fixture(scope="module")
def tok(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


def _write(tmp_path, lines) -> str:
    p = tmp_path / "train.jsonl"
    p.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(p)


def test_chat_trains_exactly_the_assistant_turns(tmp_path, tok):
    ds = load_jsonl(_write(tmp_path, [CHAT]), tok, 512)
    (ex,) = ds.examples
    full = tok.apply_chat_template(CHAT["messages"], tokenize=False)
    assert tok.decode(list(ex.ids)) == full  # the pieces put back together are the whole rendering
    trained = tok.decode([t for t, m in zip(ex.ids, ex.trained) if m])
    untrained = tok.decode([t for t, m in zip(ex.ids, ex.trained) if not m])
    assert "Hello!" in trained and "See you." in trained
    assert "Hi there" not in trained and "Be brief." not in trained and "Bye" not in trained
    assert "Hi there" in untrained and "Hello!" not in untrained


def test_text_trains_every_token_and_ends_with_eos(tmp_path, tok):
    (ex,) = load_jsonl(_write(tmp_path, [{"text": "some plain text"}]), tok, 512).examples
    assert all(ex.trained) and ex.ids[-1] == tok.eos_token_id
    assert "some plain text" in tok.decode(list(ex.ids))


def test_long_examples_are_cut_to_max_length(tmp_path, tok):
    ds = load_jsonl(_write(tmp_path, [{"text": "word " * 200}, {"text": "short"}]), tok, 16)
    assert ds.cut == 1 and max(len(e.ids) for e in ds.examples) == 16


@pytest.mark.parametrize("line,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", 'either "messages" or "text"'),
    ({"text": "a", "messages": []}, 'either "messages" or "text"'),
    ({"text": ""}, '"text" must be a non-empty string'),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user"}]}, 'string "role" and "content"'),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant message"),
])
def test_a_bad_line_is_named(tmp_path, tok, line, message):
    path = _write(tmp_path, [{"text": "fine"}, "", line])
    with pytest.raises(DataError) as e:
        load_jsonl(path, tok, 64)
    assert f"train.jsonl:3: " in str(e.value) and message in str(e.value)


def test_no_trained_token_within_max_length_is_an_error(tmp_path, tok):
    chat = {"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "ok"}]}
    with pytest.raises(DataError, match=r"train.jsonl:1: no trained token within the first 16"):
        load_jsonl(_write(tmp_path, [chat]), tok, 16)


def test_empty_and_missing_files(tmp_path, tok):
    with pytest.raises(DataError, match="no examples"):
        load_jsonl(_write(tmp_path, ["", "  "]), tok, 64)
    with pytest.raises(DataError, match="no such training file"):
        load_jsonl(tmp_path / "nope.jsonl", tok, 64)


def test_packing_shuffling_and_accumulation(tmp_path, tok):
    lines = [{"text": f"example number {i} " + "x " * (i % 7)} for i in range(40)]
    examples = load_jsonl(_write(tmp_path, lines), tok, 64).examples
    config = TrainConfig(max_length=64, batch_tokens=64, grad_accum=3, seed=5)
    steps = epoch_steps(examples, config, epoch=0)
    micro = [mb for step in steps for mb in step]
    assert all(len(step) == 3 for step in steps[:-1]) and 1 <= len(steps[-1]) <= 3
    assert all(sum(len(e.ids) for e in mb) <= 64 for mb in micro)
    assert sorted(e.line for mb in micro for e in mb) == list(range(1, 41))  # each example once
    assert any(len(mb) > 1 for mb in micro)  # packed
    assert steps == epoch_steps(examples, config, epoch=0)  # the seed fixes the order
    assert steps != epoch_steps(examples, config, epoch=1)  # a new order each epoch
    unpacked = epoch_steps(examples, TrainConfig(max_length=64, batch_tokens=64, packing=False), 0)
    assert all(len(mb) == 1 for step in unpacked for mb in step)


class _RewritingTemplate:
    """A tokenizer whose template renders earlier turns differently once later ones follow (as some
    'thinking' templates drop earlier reasoning)."""

    chat_template = "x"
    eos_token_id = None

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        last = len(messages) - 1
        body = "".join(f"<{m['role']}>{m['content'] if i == last else m['content'][:1]}" for i, m in enumerate(messages))
        return body + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    with pytest.raises(DataError, match=r"train.jsonl:1: the chat template does not render"):
        load_jsonl(_write(tmp_path, [CHAT]), _RewritingTemplate(), 512)
