"""The model runner: one batched step = embed -> every block (acquired from the weights) -> head.

It owns the device-side state (KV cache, rotary tables) and turns the scheduler's chunks into
StepInputs once per step, so the per-block loop does nothing but math and streaming. Where a block's
weights come from is the weights package's business: the runner only acquires and releases them.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from . import model as M
from . import ops
from .arch import LayerAttention, ModelConfig
from .attention_backend import AttentionScratch
from .block_manager import NULL_BLOCK, BlockCopy
from .kv_cache import KVCache
from .lora_serving import AdapterSet, LoRARows
from .offload_compute import OffDeviceCompute
from .placement import GroupPlacement, PathPolicy, StepShape, TensorGroup
from .scheduler import ScheduledChunk
from .weights import ModelWeights, StreamStats


@dataclass(frozen=True)
class StepTiming:
    seconds: float
    stream: StreamStats  # what streaming did during this step


class TokenIdError(ValueError):
    """A token id outside the vocabulary: on a GPU, the embedding lookup would raise a device-side
    assert that leaves the CUDA context unusable for every later step."""


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise TokenIdError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def upload(groups: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Lists of ints -> int64 tensors on `device`, through one host->device copy: the step's inputs
    are a few hundred bytes, so each copy costs its fixed latency (and, from pageable memory, a
    host sync); one pinned buffer copied with non_blocking=True pays it once and lets the host go
    on. The pinned buffer is freed while the copy may still run: torch's pinned allocator keeps it
    until the copy's stream passes that point. Returns views into the one device buffer."""
    flat = [v for g in groups for v in g]
    host = torch.tensor(flat, dtype=torch.long, pin_memory=device.type == "cuda")  # (total,)
    return list(torch.split(host.to(device, non_blocking=True), [len(g) for g in groups]))


def _prefill_keys(starts: list[int], counts: list[int], window: int | None) -> int:
    """The keys the tokens of a step's multi-token chunks attend to in all: a chunk of `count` tokens
    from position `start` reads start + 1, ..., start + count keys (at most `window` each). One-token
    chunks (decodes) are left out: token by token is their measured better path at any context."""
    total = 0
    for start, count in zip(starts, counts):
        if count == 1:
            continue
        if window is None or start + count <= window:
            total += count * start + count * (count + 1) // 2
        else:
            total += sum(min(p + 1, window) for p in range(start, start + count))
    return total


def _padded_tables(chunks: list[ScheduledChunk], group: int, max_blocks: int) -> list[int]:
    """The chunks' block tables of a KV group, each cut or padded to max_blocks with block 0, flattened.
    Padding blocks are never attended (keys past a sequence's end are masked), so block 0 will do; so
    will it for a block a sliding window released (NULL_BLOCK): its keys are masked too."""
    out: list[int] = []
    for c in chunks:
        table = _table(c.seq, group)[:max_blocks]
        out += table + [0] * (max_blocks - len(table))
    if NULL_BLOCK in out:  # only a windowed group's tables hold released entries
        out = [max(b, 0) for b in out]
    return out


def _table(seq, group: int) -> list[int]:
    """A sequence's block table of a KV group (engine.kv_groups): group 0's is Sequence.block_table."""
    return seq.block_table if group == 0 else seq.kv_tables[group - 1]


class ModelRunner:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, kv: KVCache, device: torch.device,
                 dtype: torch.dtype, attn_chunk_bytes: int | None = None,
                 placement: GroupPlacement | None = None, offload_policy: PathPolicy | None = None):
        self.cfg = cfg
        self.attn_chunk_bytes = attn_chunk_bytes  # the plan's, which its workspace estimate assumed
        self.device = device
        self.dtype = dtype
        self.weights = weights
        self.kv = kv
        self.globals = weights.globals
        self.inv_freq, self.rope_scaling = M.rotary_inv_freq(cfg)
        self.inv_freq = self.inv_freq.to(device)
        # What each block's attention is (window, RoPE table), and the distinct kinds in block order: a
        # step's mask and rotary tables are built once per kind, not per block.
        # Each block's KV group (engine.kv_groups: whose block tables it reads) goes with its kind.
        self.layer_kinds = [(cfg.layer_attention(i), kv.layer_groups[i]) for i in range(cfg.num_layers)]
        self.kinds = list(dict.fromkeys(self.layer_kinds))
        self.groups = sorted(set(kv.layer_groups))
        self.local_inv_freq = None
        if any(k.rope == "local" for k, _ in self.kinds):
            local, self.local_rope_scaling = M.rotary_inv_freq(cfg, "local")
            self.local_inv_freq = local.to(device)
        self.long_inv_freq = M.rotary_inv_freq(cfg, "long")[0].to(device) if cfg.rope_long_inv_freq else None
        self.last_step: StepTiming | None = None
        self.attn_scratch = AttentionScratch()
        # Tensor groups the plan placed off the device (issue #38): computed where each step's path says.
        self.offload = OffDeviceCompute(cfg, weights, dtype, placement, offload_policy)

    def _step_inputs(self, chunks: list[ScheduledChunk]) -> M.StepInputs:
        """The step's inputs as block 0 sees them (as every block does, unless the model mixes layer kinds)."""
        return self._layer_step_inputs(chunks)[0]

    def _layer_step_inputs(self, chunks: list[ScheduledChunk]) -> list[M.StepInputs]:
        """The step's inputs of every block: one StepInputs per layer kind (window, RoPE table), shared by
        the blocks of that kind."""
        ids, positions, logits_index, prompt_rows, lora_slots = [], [], [], [], []
        slot_mapping = {g: [] for g in self.groups}
        starts, counts = [], []
        bs = self.kv.block_size
        for c in chunks:
            first = len(ids)
            ids += c.token_ids()
            positions += range(c.start, c.start + c.count)
            lora_slots += [c.seq.lora_slot] * c.count
            for g in self.groups:
                table = _table(c.seq, g)
                slot_mapping[g] += [table[p // bs] * bs + p % bs for p in range(c.start, c.start + c.count)]
            logits_index += range(len(ids) - c.num_logits, len(ids))
            prompt_rows += (first + p - c.start for p in c.prompt_logit_positions)
            starts.append(c.start)
            counts.append(c.count)
        logits_index += prompt_rows  # after every sampled row, so sampled rows keep their chunk order
        check_token_ids(ids, self.cfg.vocab_size)
        mq = max(counts)
        ctx = max(s + n for s, n in zip(starts, counts))
        pad_rows = None
        if len(chunks) * mq != len(ids):
            pad_rows = [i * mq + j for i, n in enumerate(counts) for j in range(n)]  # (tokens,)
        max_blocks = -(-ctx // bs)
        # (seqs, max_blocks) per group, flattened for the upload
        tables = {g: _padded_tables(chunks, g, max_blocks) for g in self.groups}
        ids_t, pos, logits_t, starts_t, counts_t, pad_t, *per_group = upload(
            [ids, positions, logits_index, starts, counts, pad_rows or []]
            + [slot_mapping[g] for g in self.groups] + [tables[g] for g in self.groups], self.device)
        slots_t = dict(zip(self.groups, per_group[:len(self.groups)]))
        block_tables = {g: t.view(len(chunks), max_blocks) for g, t in zip(self.groups, per_group[len(self.groups):])}
        dev = self.device
        rotary = {"global": self._global_rotary(chunks, pos), None: (None, None)}
        if self.local_inv_freq is not None:
            rotary["local"] = M.rotary_cos_sin(pos, self.local_inv_freq, self.local_rope_scaling, self.dtype)
        t = torch.arange(mq, device=dev)
        q_pos = starts_t[:, None] + t[None, :]  # (seqs, max_query)
        valid = t[None, :] < counts_t[:, None]  # (seqs, max_query)
        keys = torch.arange(ctx, device=dev)
        causal = keys[None, None, :] <= q_pos[:, :, None]  # (seqs, max_query, context)
        # window -> (mask (seqs, 1, max_query, keys from first_block * bs), open keys, first_block)
        masks = {}
        windows = list(dict.fromkeys(k.window for k, _ in self.kinds))
        for window in windows:
            first_block, open_keys = 0, min(starts)  # every row's causal mask admits the keys before the earliest chunk
            if window is not None and window < ctx:
                # A windowed block gathers from the first block its earliest query reads, not from position 0.
                first_block, open_keys = max(0, min(starts) - window + 1) // bs, 0
                k = keys[first_block * bs:]
                mask = (k[None, None, :] <= q_pos[:, :, None]) & (k[None, None, :] > q_pos[:, :, None] - window)
            else:
                mask = causal.clone() if len(windows) > 1 else causal
            # Padding rows attend to the first key only, so softmax never sees an all-masked row (NaN).
            mask[..., 0] |= ~valid
            masks[window] = mask[:, None], open_keys, first_block
        token_tables = None
        # One choice for every block: by the keys of the widest kind (a full-attention block reads them all).
        widest = None if any(k.window is None for k, _ in self.kinds) else max(k.window for k, _ in self.kinds)
        if mq > 1 and ops.tokenwise_attention_pays(self.device, self.dtype, _prefill_keys(starts, counts, widest)):
            # (tokens, max_blocks) per group
            token_tables = {g: t.repeat_interleave(counts_t, dim=0) for g, t in block_tables.items()}
        first, group = self.kinds[0]
        step = M.StepInputs(
            input_ids=ids_t,
            positions=pos,
            cos=rotary[first.rope][0],
            sin=rotary[first.rope][1],
            slot_mapping=slots_t[group],
            block_tables=block_tables[group],
            pad_rows=pad_t if pad_rows is not None else None,
            max_query=mq,
            context_len=ctx,
            attn_mask=masks[first.window][0],
            logits_index=logits_t,
            attn_chunk_bytes=self.attn_chunk_bytes,
            open_keys=masks[first.window][1],
            attn_scratch=self.attn_scratch,
            token_tables=token_tables[group] if token_tables is not None else None,
            window=first.window,
            first_block=masks[first.window][2],
            lora=LoRARows.of(lora_slots, dev),
        )
        by_kind: dict[tuple[LayerAttention, int], M.StepInputs] = {(first, group): step}
        for kind, g in self.kinds[1:]:
            (cos, sin), (mask, open_keys, first_block) = rotary[kind.rope], masks[kind.window]
            by_kind[kind, g] = dataclasses.replace(
                step, cos=cos, sin=sin, attn_mask=mask, open_keys=open_keys, window=kind.window,
                first_block=first_block,
                slot_mapping=slots_t[g], block_tables=block_tables[g],
                token_tables=token_tables[g] if token_tables is not None else None)
        return [by_kind[k] for k in self.layer_kinds]

    def _global_rotary(self, chunks: list[ScheduledChunk], pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (tokens, 1, rotary_dim) of the global table. LongRoPE: each sequence's tokens by the long
        table once the sequence is longer than rope_long_after (its known tokens, or the positions this step
        feeds, drafts included), as transformers chooses for a forward pass over it."""
        short = None
        if self.long_inv_freq is not None:
            long = [max(c.seq.num_tokens, c.start + c.count) > self.cfg.rope_long_after for c in chunks]
            if all(long):
                return M.rotary_cos_sin(pos, self.long_inv_freq, self.rope_scaling, self.dtype)
            if any(long):
                rows = torch.tensor([x for c, x in zip(chunks, long) for _ in range(c.count)], device=pos.device)
                short = M.rotary_cos_sin(pos, self.inv_freq, self.rope_scaling, self.dtype)
                lng = M.rotary_cos_sin(pos, self.long_inv_freq, self.rope_scaling, self.dtype)
                pick = rows[:, None, None]  # (tokens, 1, 1)
                return torch.where(pick, lng[0], short[0]), torch.where(pick, lng[1], short[1])
        return M.rotary_cos_sin(pos, self.inv_freq, self.rope_scaling, self.dtype)

    def _moe_block(self, block: int, x: torch.Tensor, w: dict[str, torch.Tensor], k_cache: torch.Tensor,
                   v_cache: torch.Tensor, step: M.StepInputs, shape: StepShape) -> torch.Tensor:
        """A mixture-of-experts block. The routing reaches the host (M.route), then the weights package
        hands over the union of the experts the step's tokens chose, in groups its expert cache can
        hold; each group's outputs are added as it arrives, into zeros, and the shared expert's output after
        them (transformers' order). Routed experts (or a shared expert) the plan put off the device compute
        where the step's path says (engine.offload_compute); attention, norms and the router stay on the device.
        Routed experts on the CPU overlap a shared expert the device computes (resident, or streamed): its kernels
        are enqueued while the activations cross and before the host computes."""
        cfg = self.cfg
        h = M.attention_residual(x, w, k_cache, v_cache, step, cfg)  # (tokens, hidden)
        hn = M.norm(h, w["mlp_norm"], cfg)
        routing = M.route(hn, w, cfg)
        off_shared = self.offload.group(block, "mlp")  # the shared expert, where the plan put it off the device
        s = None  # (tokens, hidden) the shared expert's output
        if off_shared is not None and self.offload.on_cpu(off_shared, shape):
            # First: the link carries one crossing at a time.
            s = self.offload.mlp(block, off_shared, hn, shape, M.shared_expert)
        routed = self.offload.group(block, "experts")
        if routed is not None:
            routed_sum = self.offload.experts(block, routed, hn, routing)
        # The device's shared expert (resident, or streamed) is enqueued before the CPU computes routed experts.
        if off_shared is not None and s is None:
            s = self.offload.mlp(block, off_shared, hn, shape, M.shared_expert)
        elif s is None and "shared.w_down" in w:
            s = M.shared_expert(hn, w)
        if routed is not None:
            out = routed_sum()
        else:
            out = torch.zeros_like(hn)  # (tokens, hidden)
            for group in self.weights.experts(block, routing.chosen, h, self._guess_experts):
                M.moe_experts(hn, routing, group, out, cfg.moe)
        return h + (out if s is None else out + s)

    def _off_device_mlp_block(self, block: int, mlp: TensorGroup, x: torch.Tensor, w: dict[str, torch.Tensor],
                              k_cache: torch.Tensor, v_cache: torch.Tensor, step: M.StepInputs,
                              shape: StepShape) -> torch.Tensor:
        """A dense block whose MLP lies off the device: attention and the norms around the MLP on the device,
        the MLP where the policy says. On the CPU only its input and output cross the link (the same math,
        on host tensors); streamed, its weights cross instead."""
        cfg = self.cfg
        h = M.attention_residual(x, w, k_cache, v_cache, step, cfg)  # (tokens, hidden)
        hn = M.mlp_input(h, w, cfg)  # (tokens, hidden)
        m = self.offload.mlp(block, mlp, hn, shape, lambda x, mw: M.mlp(x, mw, activation=cfg.family.activation))
        return M.mlp_output(h, m, w, cfg)

    def _guess_experts(self, hidden: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """The router the expert tier guesses the next MoE block's experts with: (tokens, top_k) ids."""
        return M.guess_experts(hidden, w, self.cfg)

    @torch.inference_mode()
    def copy_kv_blocks(self, copies: list[BlockCopy]) -> None:
        """The KV block copies scheduling queued (host tier <-> pool), before the pass that reads them."""
        self.kv.copy_blocks(copies)

    def kv_bytes_swapped(self) -> tuple[int, int]:
        """Bytes copied pool -> host tier and host tier -> pool since start."""
        return self.kv.bytes_swapped_out, self.kv.bytes_swapped_in

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], adapters: AdapterSet | None = None) -> torch.Tensor:
        """Run one step; returns fp32 logits (rows, vocab): each chunk's num_logits rows in chunk order
        (one per sampling chunk; 1 + k for a speculative verify chunk), then the rows of
        `prompt_logit_positions` of every chunk, in chunk order. adapters: the served LoRA adapters, which
        the chunks' sequences name by slot (Sequence.lora_slot); each block's targeted projections get the
        adapters of the step's rows."""
        t0 = time.perf_counter()
        before = self.weights.stream_stats
        steps = self._layer_step_inputs(chunks)
        step = steps[0]
        shape = StepShape(sum(c.count for c in chunks))
        self.offload.begin_step()
        assert step.lora is None or adapters is not None, "a sequence names an adapter but none are served"
        x = M.scale_embeddings(self.globals.embed(step.input_ids), self.cfg)  # (tokens, hidden)
        with ops.single_row_products(x):  # one bf16 row: torch's matrix-vector kernel, not oneDNN's (but with AMX)
            try:
                for block in range(self.cfg.num_layers):
                    w = self.weights.acquire(block)
                    if step.lora is not None:
                        w = adapters.adapt(block, w, step.lora)
                    k_cache, v_cache = self.kv.layer(block)
                    mlp = self.offload.dense_mlp(block)
                    if self.cfg.is_moe_layer(block):
                        x = self._moe_block(block, x, w, k_cache, v_cache, steps[block], shape)
                    elif mlp is not None:
                        x = self._off_device_mlp_block(block, mlp, x, w, k_cache, v_cache, steps[block], shape)
                    else:
                        x = M.block_forward(x, w, k_cache, v_cache, steps[block], self.cfg)
                    self.weights.release(block)
            except BaseException:
                # A half-finished pass leaves the prefetcher ahead of where the next step starts.
                self.weights.reset()
                raise
            logits = M.final_logits(x, self.globals.norm, self.globals.head, step, self.cfg)
        self.offload.end_step(shape.tokens)
        if logits.device.type == "cuda":
            # The step's device: the thread's current device defaults to cuda:0 whatever the model's.
            torch.cuda.current_stream(logits.device).synchronize()
        self.last_step = StepTiming(time.perf_counter() - t0, self.weights.stream_stats.since(before))
        return logits
