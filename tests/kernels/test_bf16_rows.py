"""The AVX512-BF16 kernel for 1-16 bf16 rows (engine/kernels/bf16_rows.cpp) against a float64 reference
and against F.linear; where it applies and where it hands over to at::linear; engine/model.py's linear
routing decode steps of a few sequences to it. Its off switch and its fallback when it cannot be built
are in tests/kernels/test_optional_kernels.py, with the other optional kernels'.

Where the kernel cannot run (no AVX512-BF16, no compiler) the kernel tests skip and the routing test
still runs. The first run of a fresh cache compiles it (~1 min)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import ops
from engine.kernels import bf16_rows as br

module = br.bf16_rows()  # the kernel itself, also where the engine prefers oneDNN's AMX path for 2-16 rows
needs_kernel = pytest.mark.skipif(module is None, reason="the AVX512-BF16 rows kernel is not available here")

# (out, in): the benchmark model's and SmolLM2's shapes, and small ones whose out is not a multiple of
# the 4-row weight tile; in spans one K block (16 KB of x) and several (2816 at 8 rows: 1024 per block;
# at 16 rows: 512).
SHAPES = [(1536, 1024), (1024, 2816), (576, 576), (50, 96), (7, 64), (3, 32),
          (40, 2048), (24, 8192)]  # rows 4 and 16 KiB apart: the tile stages its lines (bf16_rows.cpp, STAGED)


def _data(out: int, inner: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=g).bfloat16()
    w = (torch.randn(out, inner, generator=g) / inner ** 0.5).bfloat16()
    b = torch.randn(out, generator=g).bfloat16()
    return x, w, b


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of bf16 at |v| (8 significant bits), float64."""
    e = torch.floor(torch.log2(v.abs().clamp_min(2.0 ** -126)))
    return torch.exp2(e - 7)


@needs_kernel
@pytest.mark.parametrize("out,inner", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_is_as_accurate_as_f_linear(out, inner, rows, bias):
    """Each output within one bf16 ulp of the float64 product (the fp32 sum, then one rounding), and
    the mean error no larger than F.linear's (the same math summed in another order)."""
    x, w, b = _data(out, inner, rows)
    assert module.applies(x, w)
    bias_t = b if bias else None
    y = module.linear(x, w, bias_t)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)  # (rows, out)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
    err = (y.double() - ref).abs()
    assert (err <= _bf16_ulp(ref) + 1e-6 * ref.abs().max()).all(), err.max()
    torch_err = (F.linear(x, w, bias_t).double() - ref).abs()
    assert err.mean() <= torch_err.mean() * 1.05 + 1e-9


@needs_kernel
@pytest.mark.parametrize("rows", [2, 16])
def test_staged_tiles_are_the_same_arithmetic(rows):
    """Rows a multiple of 4 KiB apart take the staged tile, others the direct one: the same products summed in
    the same order. K = 2048 is staged, the same product padded with zeros to K = 2080 is not; the zeros add
    nothing, so the two agree bit for bit."""
    x, w, b = _data(48, 2048, rows, seed=5)
    padded_x = torch.cat([x, torch.zeros(rows, 32, dtype=x.dtype)], dim=1)
    padded_w = torch.cat([w, torch.zeros(48, 32, dtype=w.dtype)], dim=1)
    assert module.applies(x, w) and module.applies(padded_x, padded_w)
    assert torch.equal(module.linear(x, w, b), module.linear(padded_x, padded_w, b))


@needs_kernel
def test_special_values_pass_through():
    x, w, _ = _data(8, 64, 3)
    x[0, 5] = float("inf")
    x[1, 7] = float("nan")
    y = module.linear(x, w)
    ref = F.linear(x.float(), w.float())
    assert torch.equal(torch.isnan(y[:2]), torch.isnan(ref[:2])) and torch.isnan(y[1]).all()
    assert torch.equal(y[2], module.linear(x[2:].repeat(2, 1), w)[0])  # rows do not mix


@needs_kernel
@pytest.mark.parametrize("rows", [1, 14])
def test_threads_split_outputs_without_changing_a_bit(rows):
    x, w, b = _data(1030, 576, rows, seed=3)
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = module.linear(x, w, b)
        torch.set_num_threads(2)
        two = module.linear(x, w, b)
    finally:
        torch.set_num_threads(was)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("case", ["no rows", "seventeen rows", "2 rows of 5632 inputs", "2 rows of 16384 inputs",
                                  "K not a multiple of 32",
                                  "float32", "strided x", "3-d x", "float32 bias"])
def test_where_it_does_not_apply_it_is_at_linear(case):
    """Outside its cases linear() is at::linear itself: the same result bit for bit, or the same error."""
    x, w, b = _data(40, 64, 4)
    bias = None
    if case == "no rows":
        x = x[:0]
    elif case == "seventeen rows":
        x = torch.randn(17, 64).bfloat16()
    elif case.startswith("2 rows of"):  # oneDNN is the faster there (docs/benchmarks/bf16-rows.md)
        k = int(case.split()[3])  # past 4096, not staged (5632), or past what staged tiles take (16384)
        x, w = torch.randn(2, k).bfloat16(), torch.randn(40, k).bfloat16()
        assert module.applies(x[:1], w)  # one row still takes the kernel
    elif case == "K not a multiple of 32":
        x, w = x[:, :48].contiguous(), w[:, :48].contiguous()
    elif case == "float32":
        x, w = x.float(), w.float()
    elif case == "strided x":
        x = torch.randn(4, 128).bfloat16()[:, ::2]
    elif case == "3-d x":
        x = x.view(2, 2, 64)
    elif case == "float32 bias":
        bias = b.float()
    if case == "float32 bias":  # F.linear refuses mixed dtypes; so does linear(), with torch's own error
        assert module.applies(x, w)
        with pytest.raises(RuntimeError) as theirs:
            F.linear(x, w, bias)
        with pytest.raises(RuntimeError) as ours:
            module.linear(x, w, bias)
        assert str(ours.value).splitlines()[0] == str(theirs.value).splitlines()[0]
        return
    assert not module.applies(x, w)
    assert torch.equal(module.linear(x, w, bias), F.linear(x, w, bias))


@pytest.mark.parametrize("amx", [False, True], ids=["no-amx", "amx"])
def test_model_linear_routes_one_to_sixteen_bf16_rows(monkeypatch, amx):
    """engine/model.py's linear: the kernel for 1-16 bf16 rows on the CPU (while it is loaded; one row only
    where oneDNN has AMX tiles), F.linear for seventeen, float32, and when the kernel is off."""
    calls = []

    class Spy:
        MAX_ROWS = 16

        def linear(self, x, w, bias=None):
            calls.append(x.shape[0])
            return F.linear(x, w, bias)

    monkeypatch.setattr(ops, "bf16_rows", lambda: Spy())
    monkeypatch.setattr(br, "onednn_has_amx", lambda: amx)
    w = torch.randn(8, 64).bfloat16()
    for rows in (1, 2, 16, 17):
        ops.linear(torch.randn(rows, 64).bfloat16(), w)
    ops.linear(torch.randn(4, 64), w.float())
    expected = [1] if amx else [1, 2, 16]
    assert calls == expected
    monkeypatch.setattr(ops, "bf16_rows", lambda: None)
    ops.linear(torch.randn(4, 64).bfloat16(), w)
    assert calls == expected


@needs_kernel
def test_a_decode_step_of_four_sequences_is_unchanged_in_tokens(monkeypatch, tmp_path):
    """A bf16 model decoding four sequences side by side (steps of 4 rows) gives the same greedy tokens
    with the kernel and with F.linear, and log-probabilities within bf16 noise of each other."""
    from engine import LLM, SamplingParams
    from tests.support.models import build

    path = build(tmp_path, "llama", dtype=torch.bfloat16)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    monkeypatch.setattr(br, "onednn_has_amx", lambda: False)  # 4 rows: the kernel's where AMX is not
    runs, calls = [], []
    real = module

    class Spy:
        MAX_ROWS = real.MAX_ROWS

        def linear(self, x, w, bias=None):
            calls.append(x.shape[0])
            return real.linear(x, w, bias)

    for kernel in (Spy(), None):
        monkeypatch.setattr(ops, "bf16_rows", lambda k=kernel: k)
        llm = LLM(str(path), max_model_len=64, max_num_seqs=4)
        try:
            outs = llm.generate(prompts, params)
            runs.append([o.outputs[0] for o in outs])
        finally:
            llm.close()
    assert 4 in calls
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs):
            assert abs(la.logprob - lb.logprob) < 0.05  # bf16 logits: ~3 significant digits
            assert abs(la.logprob - lb.logprob) <= 0.02 * abs(lb.logprob) + 0.01
