"""Training data: a JSONL file of {"messages": [...]} (chat, rendered with the model's chat template, the
loss on assistant turns only) or {"text": ...} (every token trained) -> Examples; then each epoch's steps:
a seeded shuffle, examples packed whole into micro-batches of at most batch_tokens tokens, grad_accum
micro-batches a step.

A chat's tokens are the template's rendering cut at every assistant turn's edges (the conversation before
the turn with the generation prompt; through the turn), each piece tokenized alone: the trained tokens are
exactly the assistant's text and its end-of-turn marker, whatever the tokenizer merges across the cut.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from .batch import Example
from .config import TrainConfig

ROLES = ("system", "user", "assistant", "tool", "developer")


class DataError(ValueError):
    """A line of the training file is not a usable example; the message names the file and line."""


@dataclass(frozen=True)
class Dataset:
    examples: list[Example]
    cut: int  # examples longer than max_length, cut to it
    path: str

    @property
    def targets(self) -> int:
        return sum(e.targets for e in self.examples)


def load_jsonl(path: str | Path, tokenizer, max_length: int) -> Dataset:
    """Every example of the file, tokenized; DataError names the first bad line (nothing is trained on a
    file with one)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such training file")
    examples, cut = [], 0
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = _example(line, tokenizer, n)
            except DataError as e:
                raise DataError(f"{path}:{n}: {e}") from None
            if len(ex.ids) > max_length:
                ex = Example(ex.ids[:max_length], ex.trained[:max_length], n)
                cut += 1
            if ex.targets == 0:
                raise DataError(f"{path}:{n}: no trained token within the first {max_length} tokens "
                                "(the assistant's turns start after --max-length)")
            examples.append(ex)
    if not examples:
        raise DataError(f"{path}: no examples (the file is empty)")
    return Dataset(examples, cut, str(path))


def _example(line: str, tokenizer, n: int) -> Example:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict) or ("messages" in obj) == ("text" in obj):
        raise DataError('each line must be an object with either "messages" or "text"')
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text:
            raise DataError('"text" must be a non-empty string')
        ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
        eos = tokenizer.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)  # the model learns where a text ends
        return Example(tuple(ids), tuple([True] * len(ids)), n)
    return _chat_example(obj["messages"], tokenizer, n)


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError('"messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(f'message {i} must be an object with string "role" and "content"')
        if m["role"] not in ROLES:
            raise DataError(f"message {i} has role {m['role']!r}; expected one of {', '.join(ROLES)}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant message: nothing to train on")


def _chat_example(messages, tokenizer, n: int) -> Example:
    _check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("the model's tokenizer has no chat template; use {\"text\": ...} lines")

    def render(msgs, gen: bool) -> str:
        try:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
        except Exception as e:  # noqa: BLE001 - a template's own error (e.g. roles that must alternate)
            raise DataError(f"the chat template refused this conversation: {e}") from None

    pieces: list[tuple[str, bool]] = []
    done = ""
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:k], True)  # through the assistant header
        through = render(messages[:k + 1], False)
        if not before.startswith(done) or not through.startswith(before):
            raise DataError("the chat template does not render a conversation's beginning as the beginning of "
                            "the whole (it rewrites earlier turns); cannot tell the assistant's tokens apart")
        pieces += [(before[len(done):], False), (through[len(before):], True)]
        done = through
    full = render(messages, False)
    if not full.startswith(done):
        raise DataError("the chat template renders the whole conversation differently from its parts")
    pieces.append((full[len(done):], False))
    ids, trained = [], []
    for text, train in pieces:
        if not text:
            continue
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        trained += [train] * len(piece)
    return Example(tuple(ids), tuple(trained), n)


def epoch_steps(examples: list[Example], config: TrainConfig, epoch: int) -> list[list[list[Example]]]:
    """One epoch as optimizer steps, each a list of micro-batches, each a list of examples: shuffled with
    (seed, epoch), packed first-fit in that order (packing off: one example per micro-batch). The last
    step may have fewer micro-batches."""
    order = list(range(len(examples)))
    random.Random(config.seed * 1_000_003 + epoch).shuffle(order)
    micro: list[list[Example]] = []
    current, size = [], 0
    for i in order:
        e = examples[i]
        if current and (not config.packing or size + len(e.ids) > config.batch_tokens):
            micro.append(current)
            current, size = [], 0
        current.append(e)
        size += len(e.ids)
    if current:
        micro.append(current)
    return [micro[i:i + config.grad_accum] for i in range(0, len(micro), config.grad_accum)]
