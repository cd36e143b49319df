"""A micro-batch of training sequences as the model math takes a step: flat tokens, each sequence its own
(so packed examples never attend to each other, and each starts at position 0), and the rows the loss reads.

Attention reads keys from a KV "cache" the way inference does; in training every key is written by the
same pass, so each block gets a fresh scratch of one cache block per sequence (block_size = the longest
sequence): block_tables is the identity and slot_mapping = sequence * max_query + position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..arch import ModelConfig
from ..model import StepInputs, rotary_cos_sin, rotary_inv_freq


@dataclass(frozen=True)
class Example:
    """One tokenized training example: ids and, per token, whether the loss predicts it."""

    ids: tuple[int, ...]
    trained: tuple[bool, ...]  # trained[t]: token t is a target (assistant turns; every token of plain text)
    line: int = 0  # the JSONL line it came from (1-based), for messages

    @property
    def targets(self) -> int:
        """Tokens the loss predicts: every trained token but the first (nothing precedes it)."""
        return sum(self.trained[1:])


@dataclass(frozen=True)
class MicroBatch:
    """Device tensors of one micro-batch; steps[i] is block i's StepInputs."""

    steps: list[StepInputs]
    loss_rows: torch.Tensor  # (targets,) int64: flat token rows whose next token is a target
    labels: torch.Tensor  # (targets,) int64: those next tokens
    seqs: int
    max_query: int
    tokens: int


def build_micro_batch(examples: list[Example], cfg: ModelConfig, dtype: torch.dtype,
                      device: torch.device) -> MicroBatch:
    ids, positions, rows, labels = [], [], [], []
    counts = [len(e.ids) for e in examples]
    mq = max(counts)
    for s, e in enumerate(examples):
        first = len(ids)
        ids += e.ids
        positions += range(len(e.ids))
        for t in range(len(e.ids) - 1):
            if e.trained[t + 1]:
                rows.append(first + t)
                labels.append(e.ids[t + 1])
    seqs = len(examples)
    pad_rows = [s * mq + j for s, n in enumerate(counts) for j in range(n)]
    slot = torch.tensor(pad_rows, dtype=torch.long)  # one cache block of mq slots per sequence
    ids_t = torch.tensor(ids, dtype=torch.long, device=device)
    pos = torch.tensor(positions, dtype=torch.long, device=device)
    counts_t = torch.tensor(counts, device=device)
    t = torch.arange(mq, device=device)
    valid = t[None, :] < counts_t[:, None]  # (seqs, max_query)
    causal = t[None, None, :] <= t[None, :, None]  # (1, max_query, context = max_query)
    inv, scaling = rotary_inv_freq(cfg)
    rotary = {"global": rotary_cos_sin(pos, inv.to(device), scaling, dtype), None: (None, None)}
    if cfg.local_rope_inv_freq:
        inv_l, scaling_l = rotary_inv_freq(cfg, "local")
        rotary["local"] = rotary_cos_sin(pos, inv_l.to(device), scaling_l, dtype)
    base = StepInputs(
        input_ids=ids_t, positions=pos, cos=None, sin=None,
        slot_mapping=slot.to(device), block_tables=torch.arange(seqs, device=device)[:, None],
        pad_rows=None if len(ids) == seqs * mq else slot.to(device), max_query=mq, context_len=mq,
        attn_mask=causal[None].expand(seqs, 1, mq, mq), logits_index=torch.empty(0, dtype=torch.long, device=device))
    by_kind: dict = {}
    steps = []
    for layer in range(cfg.num_layers):
        kind = cfg.layer_attention(layer)
        if kind not in by_kind:
            mask = causal.expand(seqs, mq, mq).clone()  # (seqs, max_query, context)
            if kind.window is not None and kind.window < mq:
                mask &= t[None, None, :] > t[None, :, None] - kind.window
            mask[..., 0] |= ~valid  # padding rows attend to key 0 only: no all-masked row (NaN)
            cos, sin = rotary[kind.rope]
            by_kind[kind] = dataclasses.replace(base, cos=cos, sin=sin, attn_mask=mask[:, None], window=kind.window)
        steps.append(by_kind[kind])
    return MicroBatch(steps, torch.tensor(rows, dtype=torch.long, device=device),
                      torch.tensor(labels, dtype=torch.long, device=device), seqs, mq, len(ids))


def scratch_kv(batch: MicroBatch, cfg: ModelConfig, dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's K and V scratch: (seqs, max_query, kv_heads, head_dim) each, the layout of a KV pool of
    one block per sequence."""
    shape = (batch.seqs, batch.max_query, cfg.num_kv_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
