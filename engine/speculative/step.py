"""Speculative decoding inside an engine step: drafts proposed before the target's pass, checked after it.

  spec = SpeculativeStep(config, drafter)
  chunks = spec.draft(chunks, scheduler, max_model_len, vocab_size)
      The decode chunks of sequences that may speculate become verify chunks (their last token and k
      drafted ones), as far as the step's token budget allows.
  tokens, infos, accepted = spec.verify(chunk, rows)
      After the pass: which drafts the target accepts, and the token after them (the engine emits them).
  spec.counters (SpecCounters), spec.drafter, spec.close()
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..failures import raise_if_fatal
from ..sampler import token_logprobs
from ..scheduler import ScheduledChunk, Scheduler, Sequence
from .adaptive import DraftLength
from .config import SpeculativeConfig
from .drafter import Draft, Drafter, DraftRequest
from .stats import SpecCounters
from .verify import verify

if TYPE_CHECKING:
    import torch

log = logging.getLogger("layerstream")


class SpeculativeStep:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter):
        self.drafter = drafter
        self.counters = SpecCounters(config.method, config.num_speculative_tokens, config.adaptive_k)
        self.draft_length = DraftLength(config.num_speculative_tokens, config.adaptive_k)
        self._drafts: dict[Sequence, Draft] = {}  # this step's drafts, by sequence

    def draft(self, chunks: list[ScheduledChunk], scheduler: Scheduler, max_model_len: int,
              vocab_size: int) -> list[ScheduledChunk]:
        """The step's chunks with the decode chunks of sequences that may speculate turned into verify
        chunks (their last token and k drafted ones), as far as the step's token budget allows. k is the
        sequence's own (adaptive.DraftLength), cut so no draft runs past max_tokens or the context;
        structured-output sequences do not speculate (their grammar would have to follow every draft).
        A drafter that fails costs this step its speculation, never a request."""
        self._drafts.clear()
        budget = scheduler.config.max_num_batched_tokens - sum(c.count for c in chunks)
        requests, where = [], []
        for i, c in enumerate(chunks):
            seq, st = c.seq, c.seq.state
            if c.count != 1 or not c.samples or not seq.output_ids or st.guide is not None:
                continue
            if not st.spec_k:
                st.spec_k = self.draft_length.initial()
            k = min(st.spec_k, seq.max_tokens - len(seq.output_ids) - 1, max_model_len - seq.num_tokens, budget)
            if k >= 1:
                k = scheduler.grow_for_lookahead(seq, k)  # KV blocks for the drafted positions
            if k < 1:
                continue
            budget -= k
            requests.append(DraftRequest(seq, k, st.params, st.generator))
            where.append(i)
        if not requests:
            return chunks
        t0 = time.perf_counter()
        try:
            drafts = self.drafter.propose(requests)
        except Exception as e:  # noqa: BLE001 - a draft that fails costs speed, never a request
            raise_if_fatal(e)
            log.warning("drafting failed (%s: %s); this step runs without speculation", type(e).__name__, e)
            return chunks
        finally:
            self.counters.draft_seconds += time.perf_counter() - t0
        chunks = list(chunks)
        for i, d in zip(where, drafts):
            # A draft model's embedding table may be padded past the target's vocabulary.
            n = next((j for j, t in enumerate(d.tokens) if not 0 <= t < vocab_size), len(d.tokens))
            if n < len(d.tokens):
                d = Draft(d.tokens[:n], None if d.probs is None else d.probs[:n])
            if d.tokens:
                c = chunks[i]
                chunks[i] = ScheduledChunk(c.seq, c.start, 1 + len(d.tokens), ids=c.token_ids() + d.tokens,
                                           spec_logits=1 + len(d.tokens))
                self._drafts[c.seq] = d
        return chunks

    def verifies(self, chunks: list[ScheduledChunk]) -> bool:
        """Whether this step's pass verifies drafts (its time counts as verification)."""
        return bool(self._drafts) and any(c.ids is not None for c in chunks)

    def verify(self, chunk: ScheduledChunk, rows: torch.Tensor) -> tuple[list[int], list, int]:
        """rows: (1 + k, vocab) target logits at the last token and each draft -> (the accepted drafts
        and the token after them, their logprobs, how many drafts were accepted). The K/V of rejected
        positions stays behind num_computed, where the next pass overwrites it."""
        seq, st = chunk.seq, chunk.seq.state
        draft = self._drafts.pop(seq)
        accepted, token = verify(rows, draft, st.params, seq.prompt_ids, seq.output_ids, st.generator)
        self.counters.verified(len(draft.tokens), accepted)
        st.spec_k = self.draft_length.next(st.spec_k, len(draft.tokens), accepted)
        tokens = draft.tokens[:accepted] + [token]
        return tokens, [token_logprobs(rows[i], t, st.params) for i, t in enumerate(tokens)], accepted

    def close(self) -> None:
        self.drafter.close()
