"""One micro-batch's forward and backward over a frozen base whose blocks stream.

Forward: the blocks stream in order as in a prefill step, without autograd; each block's input is kept
in host memory (the checkpoint: the device holds one block's activations at a time). Loss: the final norm
and head over the rows that have a target, a slice of rows at a time (a (tokens, vocab) fp32 logits
matrix would dwarf a block's activations). Backward: the blocks stream again in reverse order; each is
recomputed from its checkpointed input with autograd on and its output's gradient pushed through it,
which leaves the LoRA gradients in the adapter's .grad and the input's gradient for the block before.
The weights package prefetches in that order (ModelWeights.set_visit_order: 0..n-1, n-1..0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import model as M
from ..arch import ModelConfig
from ..weights import ModelWeights
from .batch import MicroBatch, scratch_kv
from .lora import LoRAAdapter

# Rows of logits the loss forms at once: (rows, vocab) fp32 at a time.
LOSS_ROWS = 1024


def visit_order(num_layers: int) -> list[int]:
    """The blocks a training step acquires, in order: forward, then backward."""
    return list(range(num_layers)) + list(reversed(range(num_layers)))


def forward_backward(weights: ModelWeights, adapter: LoRAAdapter, batch: MicroBatch, cfg: ModelConfig,
                     dtype: torch.dtype, device: torch.device, loss_scale: float) -> float:
    """Accumulate d(loss * loss_scale)/d(adapter) into the adapter's .grad, where loss is the summed
    cross-entropy over the batch's targets; returns that sum (a host float). loss_scale = 1 / (targets
    of the whole optimizer step) makes the step's loss the mean over its targets."""
    checkpoints: list[torch.Tensor] = []  # block i's input, on the host
    host = torch.device("cpu")
    try:
        with torch.no_grad():
            x = M.scale_embeddings(weights.globals.embed(batch.steps[0].input_ids), cfg)  # (tokens, hidden)
            for i in range(cfg.num_layers):
                w = adapter.adapt(i, weights.acquire(i))
                # A copy even on the CPU: the next block's output must not overwrite a checkpoint.
                checkpoints.append(x.to(host, copy=True, non_blocking=device.type == "cuda"))
                x = M.block_forward(x, w, *scratch_kv(batch, cfg, dtype, device), batch.steps[i], cfg)
                weights.release(i)
        top = x.detach().requires_grad_()
        total = _loss_backward(top, weights, batch, cfg, loss_scale)
        grad = top.grad  # (tokens, hidden)
        for i in reversed(range(cfg.num_layers)):
            w = adapter.adapt(i, weights.acquire(i))
            xi = checkpoints.pop().to(device, non_blocking=True)
            xi.requires_grad_(i > 0)  # block 0's input is the frozen embedding: no gradient needed
            with torch.enable_grad():
                y = M.block_forward(xi, w, *scratch_kv(batch, cfg, dtype, device), batch.steps[i], cfg)
                y.backward(grad)
            grad = xi.grad
            del y, w, xi
            weights.release(i)
    except BaseException:
        # A half-finished pass leaves the prefetcher ahead of where the next pass starts.
        weights.reset()
        raise
    return total


def _loss_backward(top: torch.Tensor, weights: ModelWeights, batch: MicroBatch, cfg: ModelConfig,
                   loss_scale: float) -> float:
    """Summed cross-entropy of the head over batch.loss_rows of top (tokens, hidden), backpropagated into
    top.grad slice by slice; returns the sum."""
    g = weights.globals
    total = torch.zeros((), dtype=torch.float64, device=top.device)
    for start in range(0, batch.loss_rows.numel(), LOSS_ROWS):
        rows = batch.loss_rows[start:start + LOSS_ROWS]
        step = _Rows(rows)
        with torch.enable_grad():
            logits = M.final_logits(top, g.norm, g.head, step, cfg)  # (rows, vocab) fp32
            loss = F.cross_entropy(logits, batch.labels[start:start + LOSS_ROWS], reduction="sum")
            (loss * loss_scale).backward()
        total += loss.detach().double()
    return float(total)


class _Rows:
    """final_logits reads only logits_index from its step."""

    def __init__(self, rows: torch.Tensor):
        self.logits_index = rows


def forward_loss(weights: ModelWeights, adapter: LoRAAdapter, batch: MicroBatch, cfg: ModelConfig,
                 dtype: torch.dtype, device: torch.device) -> float:
    """The summed cross-entropy over the batch's targets, forward only (evaluation); the caller has set
    the weights' visit order to the forward pass alone."""
    try:
        with torch.no_grad():
            x = M.scale_embeddings(weights.globals.embed(batch.steps[0].input_ids), cfg)  # (tokens, hidden)
            for i in range(cfg.num_layers):
                w = adapter.adapt(i, weights.acquire(i))
                x = M.block_forward(x, w, *scratch_kv(batch, cfg, dtype, device), batch.steps[i], cfg)
                weights.release(i)
            total = 0.0
            g = weights.globals
            for start in range(0, batch.loss_rows.numel(), LOSS_ROWS):
                logits = M.final_logits(x, g.norm, g.head, _Rows(batch.loss_rows[start:start + LOSS_ROWS]), cfg)
                total += float(F.cross_entropy(logits, batch.labels[start:start + LOSS_ROWS], reduction="sum"))
    except BaseException:
        weights.reset()
        raise
    return total
