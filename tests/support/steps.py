"""The runner's step inputs from outside: the runners loads build, captured, and a step of mixed chunks."""

from __future__ import annotations

import contextlib

import pytest

from engine import model as M
from engine.scheduler import ScheduledChunk, Sequence


@contextlib.contextmanager
def capture_runners():
    """The ModelRunners loads build meanwhile, captured as they are made: these are unit tests of the
    runner's step inputs, which no public interface shows (nor should)."""
    import engine.loader as loader

    made = []

    class Captured(loader.ModelRunner):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loader, "ModelRunner", Captured)
        yield made


def mixed_chunks() -> list[ScheduledChunk]:
    """A prefill chunk, a decode and a mid-prompt chunk that does not sample, on blocks out of order
    and tables of different lengths: padding rows, padded block tables, and an empty-free logits
    index all occur."""
    a, b, c = Sequence("a", [5, 6, 7, 8, 9], 4), Sequence("b", list(range(1, 9)), 4), Sequence("c", [3] * 9, 4)
    a.block_table, b.block_table, c.block_table = [2, 7], [0, 5, 9], [3, 1, 4]  # blocks of 4 tokens
    b.output_ids = [11]
    return [ScheduledChunk(a, 0, 5), ScheduledChunk(b, 8, 1), ScheduledChunk(c, 3, 2)]


def fields(step: M.StepInputs) -> dict:
    return {k: getattr(step, k) for k in M.StepInputs.__dataclass_fields__}
