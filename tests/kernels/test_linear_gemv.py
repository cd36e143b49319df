"""ops.single_row_products: a step of one bf16 row takes torch's own matrix-vector kernel instead of
oneDNN's (faster for a single row on a CPU without AMX; with AMX oneDNN is the faster and is kept), with the
process-wide oneDNN switch always put back; where bf16_rows.cpp is in use (AVX512-BF16 without AMX) its
one-row kernel takes the row instead."""

import pytest
import torch
import torch.nn.functional as F

from engine import ops
from engine.kernels import bf16_rows as br


@pytest.fixture(autouse=True)
def without_amx(monkeypatch):
    """The switch as a CPU without AMX makes it, wherever the tests run (test_amx_keeps_onednn: with)."""
    monkeypatch.setattr(ops, "onednn_has_amx", lambda: False)


def _weights(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g).bfloat16()
    return w, b


@pytest.mark.parametrize("shape", [(576, 576), (1536, 576), (96, 160)])
def test_one_row_uses_torchs_gemv_and_matches_the_reference(shape, monkeypatch):
    monkeypatch.setattr(ops, "bf16_rows", lambda: None)  # a CPU without AVX512-BF16
    w, b = _weights(*shape)
    x = torch.randn(1, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    torch._C._set_mkldnn_enabled(False)
    try:
        expected = F.linear(x, w, b)  # torch's kernel, as the one-row path runs it
    finally:
        torch._C._set_mkldnn_enabled(True)
    with ops.single_row_products(x):
        got = ops.linear(x, w, b)
    assert torch.equal(got, expected)
    reference = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), reference, atol=0.05 * reference.abs().max().item(), rtol=1e-2)
    assert torch._C._get_mkldnn_enabled()


@pytest.mark.skipif(br.bf16_rows() is None, reason="the AVX512-BF16 rows kernel is not available here")
def test_one_row_takes_the_rows_kernel_where_it_is_in_use(monkeypatch):
    monkeypatch.setattr(ops, "bf16_rows", br.bf16_rows)
    w, b = _weights(576, 576)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    with ops.single_row_products(x):
        got = ops.linear(x, w, b)
    assert torch.equal(got, br.bf16_rows().linear(x, w, b))
    reference = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(got.double(), reference, atol=0.05 * reference.abs().max().item(), rtol=1e-2)


def test_only_single_bf16_rows_on_the_cpu_take_it():
    assert ops._one_bf16_row_on_cpu(torch.zeros(1, 8, dtype=torch.bfloat16))
    # 2-16 rows: bf16_rows.cpp (linear), which takes one row too where it is in use; more: oneDNN
    assert not ops._one_bf16_row_on_cpu(torch.zeros(2, 8, dtype=torch.bfloat16))
    assert not ops._one_bf16_row_on_cpu(torch.zeros(1, 8))  # fp32: the exact mode keeps its path
    assert not ops._one_bf16_row_on_cpu(torch.zeros(1, 8, dtype=torch.float16))  # not measured


def test_the_onednn_switch_is_restored_when_the_product_fails():
    w, _ = _weights(16, 32)
    x = torch.zeros(1, 31, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError):
        with ops.single_row_products(x):
            ops.linear(x, w)  # wrong inner size
    assert torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)  # a caller that had it off keeps it off
    try:
        x = torch.zeros(1, 32, dtype=torch.bfloat16)
        with ops.single_row_products(x):
            ops.linear(x, w)
        assert not torch._C._get_mkldnn_enabled()
    finally:
        torch._C._set_mkldnn_enabled(True)


def test_a_one_row_bf16_step_runs_without_onednn(llama_dir, monkeypatch):
    from engine import LLM, SamplingParams

    seen = []  # (rows, oneDNN enabled inside) per step
    real = ops.single_row_products

    def spy(x):
        cm = real(x)

        class Recorder:
            def __enter__(self):
                cm.__enter__()
                seen.append((x.shape[0], torch._C._get_mkldnn_enabled()))

            def __exit__(self, *exc):
                return cm.__exit__(*exc)

        return Recorder()

    monkeypatch.setattr(ops, "single_row_products", spy)
    llm = LLM(str(llama_dir), dtype="bfloat16", max_model_len=64, max_num_seqs=1)
    try:
        llm.generate([[3, 5, 7, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        llm.close()
    assert seen[0] == (4, True)  # the prompt's 4 rows keep oneDNN
    assert seen[1:] and all(s == (1, False) for s in seen[1:])  # decode steps: one row, oneDNN off
    assert torch._C._get_mkldnn_enabled()


def test_amx_keeps_onednn_for_one_row(monkeypatch):
    """With AMX, oneDNN's product is the faster at one row too: the switch is not touched."""
    monkeypatch.setattr(ops, "onednn_has_amx", lambda: True)
    x = torch.zeros(1, 8, dtype=torch.bfloat16)
    assert not ops._one_bf16_row_on_cpu(x)
    with ops.single_row_products(x):
        assert torch._C._get_mkldnn_enabled()
