"""The runner's per-step inputs: the same tensors as the plain one-copy-per-field construction, built
through a single host->device copy, and token ids checked on the host before any reaches the device."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from engine import LLM
from engine import ops
from engine import model as M
from engine.runner import TokenIdError
from engine.scheduler import ScheduledChunk, Sequence
from tests.support.steps import capture_runners, fields, mixed_chunks


def reference_step_inputs(runner, chunks: list[ScheduledChunk]) -> M.StepInputs:
    """The construction _step_inputs replaced: every field its own torch.tensor(..., device=dev)."""
    ids, positions, slot_mapping, logits_index, starts, counts = [], [], [], [], [], []
    bs = runner.kv.block_size
    for c in chunks:
        ids += c.seq.token_range(c.start, c.count)
        positions += range(c.start, c.start + c.count)
        slot_mapping += [c.seq.block_table[p // bs] * bs + p % bs for p in range(c.start, c.start + c.count)]
        if c.samples:
            logits_index.append(len(ids) - 1)
        starts.append(c.start)
        counts.append(c.count)
    dev = runner.device
    pos = torch.tensor(positions, dtype=torch.long, device=dev)
    cos, sin = M.rotary_cos_sin(pos, runner.inv_freq, runner.rope_scaling, runner.dtype)
    mq, ctx = max(counts), max(s + n for s, n in zip(starts, counts))
    starts_t = torch.tensor(starts, dtype=torch.long, device=dev)
    counts_t = torch.tensor(counts, dtype=torch.long, device=dev)
    t = torch.arange(mq, device=dev)
    q_pos = starts_t[:, None] + t[None, :]
    valid = t[None, :] < counts_t[:, None]
    keys = torch.arange(ctx, device=dev)
    mask = keys[None, None, :] <= q_pos[:, :, None]
    window = runner.cfg.sliding_window
    if window is not None and window < ctx:
        mask &= keys[None, None, :] > q_pos[:, :, None] - window
    mask[..., 0] |= ~valid
    open_keys = 0 if window is not None and window < ctx else min(starts)
    pad_rows = None
    if len(chunks) * mq != len(ids):
        pad_rows = torch.tensor([i * mq + j for i, n in enumerate(counts) for j in range(n)], dtype=torch.long,
                                device=dev)
    max_blocks = -(-ctx // bs)
    tables = [(c.seq.block_table + [0] * max_blocks)[:max_blocks] for c in chunks]
    # no sliding window in these models: a chunk's tokens read start + 1, ..., start + count keys
    prefill_keys = sum(sum(range(c.start + 1, c.start + c.count + 1)) for c in chunks if c.count > 1)
    token_tables = None
    if mq > 1 and ops.tokenwise_attention_pays(dev, runner.dtype, prefill_keys):
        token_tables = torch.tensor([tables[i] for i, c in enumerate(chunks) for _ in range(c.count)],
                                    dtype=torch.long, device=dev)
    return M.StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long, device=dev), positions=pos, cos=cos, sin=sin,
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.long, device=dev), pad_rows=pad_rows, max_query=mq,
        context_len=ctx, attn_mask=mask[:, None], open_keys=open_keys, attn_scratch=runner.attn_scratch,
        logits_index=torch.tensor(logits_index, dtype=torch.long, device=dev), token_tables=token_tables,
        window=window)


class CountTransfers(TorchFunctionMode):
    """Counts host->device transfers: a tensor made on a device from Python data (torch.tensor(...,
    device=...)), or a result on a device computed from a host tensor (.to, copy_, ...)."""

    def __init__(self):
        super().__init__()
        self.transfers: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
        on_device = any(o.device.type != "cpu" for o in outputs)
        from_data = func in (torch.tensor, torch.as_tensor) and not inputs
        if on_device and (from_data or any(i.device.type == "cpu" for i in inputs)):
            self.transfers.append(getattr(func, "__name__", str(func)))
        return out


@pytest.fixture(scope="module")
def loaded(llama_dir):
    """The engine, and the ModelRunner its load built."""
    with capture_runners() as made:
        out = LLM(str(llama_dir), max_model_len=64, max_num_seqs=4, block_size=4)
    yield out, made[0]
    out.close()


@pytest.fixture
def llm(loaded):
    return loaded[0]


@pytest.fixture
def runner(loaded):
    return loaded[1]


def with_dtype(runner, dtype: torch.dtype):
    """The runner as if it computed in dtype (only the step inputs are built with it)."""
    runner = copy.copy(runner)
    runner.dtype = dtype
    return runner


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunks", [mixed_chunks(), mixed_chunks()[1:2]], ids=["mixed", "one-decode"])
def test_step_inputs_equal_the_per_field_construction(runner, chunks, dtype):
    runner = with_dtype(runner, dtype)
    with torch.inference_mode():
        ours, ref = fields(runner._step_inputs(chunks)), fields(reference_step_inputs(runner, chunks))
    assert ours.keys() == ref.keys()
    for name, want in ref.items():
        got = ours[name]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, name
            torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)
        else:
            assert got == want, name
    step = runner._step_inputs(chunks)
    assert step.open_keys == min(c.start for c in chunks) and step.attn_mask[..., :step.open_keys].all()


def test_token_tables_only_for_short_prompt_chunks_in_16_bit(runner, monkeypatch):
    """Token-by-token attention is chosen for a step with prompt chunks in bf16 while their tokens read
    few keys (each token gets its sequence's block-table row); not in fp32 (the exact mode), not past
    the bound (the decode's keys do not count), and never for a decode-only step (its tables are per
    token already)."""
    chunks = mixed_chunks()  # prompt chunks read 15 + 9 keys, the decode 9
    with torch.inference_mode():
        step = with_dtype(runner, torch.bfloat16)._step_inputs(chunks)
        rows = [0] * 5 + [1] + [2] * 2  # each token's chunk
        assert torch.equal(step.token_tables, step.block_tables[rows])
        assert with_dtype(runner, torch.float32)._step_inputs(chunks).token_tables is None
        assert with_dtype(runner, torch.bfloat16)._step_inputs(chunks[1:2]).token_tables is None
        monkeypatch.setattr(ops, "TOKENWISE_MAX_KEYS", 24)
        assert with_dtype(runner, torch.bfloat16)._step_inputs(chunks).token_tables is not None
        monkeypatch.setattr(ops, "TOKENWISE_MAX_KEYS", 23)
        assert with_dtype(runner, torch.bfloat16)._step_inputs(chunks).token_tables is None


def test_step_inputs_take_one_host_to_device_copy(runner):
    """On the meta device every host->device transfer is visible: ours makes one per step, the
    per-field construction (which the counter must catch) eight."""
    runner = copy.copy(runner)
    runner.device = torch.device("meta")
    runner.inv_freq = runner.inv_freq.to("meta")
    chunks = mixed_chunks()
    with torch.inference_mode():
        with CountTransfers() as ours:
            step = runner._step_inputs(chunks)
        with CountTransfers() as ref:
            reference_step_inputs(runner, chunks)
    assert len(ours.transfers) == 1, ours.transfers
    assert len(ref.transfers) == 8, ref.transfers
    assert all(t.device.type == "meta" for t in fields(step).values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("bad", [-1, 512, 10**9])
def test_out_of_range_token_id_stops_on_the_host(runner, bad):
    """An id outside [0, vocab) never reaches the embedding lookup (a device-side assert on a GPU);
    the step raises before any block runs, and the next step is unaffected."""
    s = Sequence("bad", [5, bad, 7], 1)
    s.block_table = [0]
    with pytest.raises(TokenIdError, match=f"token id {bad} is outside the vocabulary \\[0, 512\\)"):
        runner.execute([ScheduledChunk(s, 0, 3)])
    ok = Sequence("ok", [5, 6, 7], 1)
    ok.block_table = [0]
    assert torch.isfinite(runner.execute([ScheduledChunk(ok, 0, 3)])).all()


def test_prompt_ids_checked_at_admission(llm, monkeypatch):
    """Token-id prompts, and a tokenizer whose added tokens lie beyond the embedding table, are refused
    when the request is added (a ValueError: the server's 400), not when the step runs."""
    engine = llm.engine
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.encode([1, 512])
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: [1, 2, 600])
    with pytest.raises(TokenIdError, match="token id 600"):
        engine.encode("hello")
    assert engine.num_waiting() == 0
