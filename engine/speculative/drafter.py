"""Draft sources behind one interface: `propose(requests) -> drafts`, one draft per sequence.

  NgramDrafter   prompt lookup over the sequence's own tokens; no model, deterministic drafts.
  ModelDrafter   a resident model run autoregressively for k tokens: a separate draft model with
                 its own KV cache (method "draft"), or the self-draft (method "self"), which runs
                 the target's own runner code over SelfDraftWeights and shares the target's KV
                 cache: the draft writes approximate K/V at the positions it drafts, and the
                 verify pass then overwrites exactly those positions with the target's.

A separate draft model's paged KV pool mirrors the target's (same number and size of blocks), so
a sequence's draft K/V lives in the blocks of its own block table; which of its positions hold
valid draft K/V is tracked here per sequence.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

from ..sampler import argmax, distribution, draw, processed_logits
from ..sampling_params import SamplingParams
from ..scheduler import ScheduledChunk, Sequence
from .ngram import ngram_draft


@dataclass
class DraftRequest:
    seq: Sequence  # its K/V is computed up to seq.num_tokens - 1 (its last token is pending)
    k: int  # tokens to draft, >= 1
    params: SamplingParams
    generator: torch.Generator  # the sequence's own: a seeded request stays reproducible


@dataclass
class Draft:
    tokens: list[int]  # at most k; [] when the source has nothing to propose
    probs: torch.Tensor | None  # (len(tokens), vocab) fp32 distributions they were drawn from; None: deterministic


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Draft]: ...

    def close(self) -> None: ...


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        return [Draft(ngram_draft(r.seq.prompt_ids + r.seq.output_ids, r.k, self.min_n, self.max_n), None)
                for r in requests]

    def close(self) -> None:
        pass


class ModelDrafter:
    """runner: a ModelRunner over the draft's weights and KV cache (engine.runner); owner: what to
    close with the drafter (a separately loaded draft model), if anything."""

    def __init__(self, runner, shares_kv: bool, owner=None):
        self.runner = runner
        self.shares_kv = shares_kv
        self.owner = owner
        # Sequence -> (its preemptions, positions [0, n) holding this draft's K/V): a separate
        # draft model only. A preempted sequence comes back with other blocks: start over.
        self._valid: weakref.WeakKeyDictionary[Sequence, tuple[int, int]] = weakref.WeakKeyDictionary()

    def _first_unseen(self, seq: Sequence) -> int:
        if self.shares_kv:
            return seq.num_computed  # the target's K/V up to there is exact; the draft reads it
        preemptions, valid = self._valid.get(seq, (seq.num_preemptions, 0))
        if preemptions != seq.num_preemptions:
            return 0
        # Draft K/V past what the target kept may hold rejected tokens: recompute from there.
        return min(valid, seq.num_computed)

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        tokens: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        # Pass 0 feeds each sequence's tokens the draft has not seen (at least the pending last
        # one); pass j feeds draft token j. Every pass batches all sequences still drafting.
        chunks = []
        for r in requests:
            start = self._first_unseen(r.seq)
            chunks.append(ScheduledChunk(r.seq, start, r.seq.num_tokens - start))
        active = list(range(len(requests)))
        while active:
            logits = self.runner.execute([chunks[i] for i in active]).cpu()  # (len(active), vocab)
            still = []
            for row, i in enumerate(active):
                r = requests[i]
                token, p = _draw(logits[row], r, tokens[i])
                tokens[i].append(token)
                if p is not None:
                    probs[i].append(p)
                if len(tokens[i]) < r.k:
                    pos = r.seq.num_tokens + len(tokens[i]) - 1
                    chunks[i] = ScheduledChunk(r.seq, pos, 1, ids=[token], spec_logits=1)
                    still.append(i)
            active = still
        for r, t in zip(requests, tokens):
            # The last draft token was never fed.
            self._valid[r.seq] = (r.seq.num_preemptions, r.seq.num_tokens + len(t) - 1)
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def close(self) -> None:
        if self.owner is not None:
            self.owner.close()
            self.owner = None


def _draw(logits: torch.Tensor, r: DraftRequest, drafted: list[int]) -> tuple[int, torch.Tensor | None]:
    """One draft token from the draft's logits, processed like the target's (penalties over what
    the output would be, bias): the closer q is to p, the more is accepted. Greedy requests take the
    argmax (verification compares argmaxes); sampled ones draw from q and return it."""
    seq = r.seq
    processed = processed_logits(logits, r.params, seq.prompt_ids, seq.output_ids + drafted)
    if r.params.greedy:
        return argmax(processed), None
    q = distribution(processed, r.params)
    if q is None:
        token = argmax(processed)
        q = torch.zeros_like(processed)
        q[token] = 1.0
        return token, q
    return draw(q, r.generator), q
