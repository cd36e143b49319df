"""Served adapters' term on the CPU (decode_block.cpp's lora_rows_add_): each row through its own adapter's
columns, against the masked products it replaced (every row times every adapter's columns, the other
adapters' masked to zero), in fp32 and bf16, with rows of the base, an adapter that leaves the weight alone,
and sizes that are not multiples of the kernel's 16 lanes."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import decode_block as db
from engine.lora_serving import LoRARows

module = db.decode_block()
pytestmark = pytest.mark.skipif(module is None, reason="the C++ decode block is not available here")


def _case(dtype: torch.dtype, tokens: int, k: int, n: int):
    g = torch.Generator().manual_seed(tokens * 1000 + k + n)
    cols = ((0, 8), (2, 4), (3, 12))  # three adapters' runs of columns; slot 1 does not adapt this weight
    r = sum(c for _, c in cols)
    slots = [[None, 0, 1, 2, 3][i % 5] for i in range(tokens)]
    rows = LoRARows.of(slots, torch.device("cpu"))
    x = torch.randn(tokens, k, generator=g).to(dtype)
    a = (torch.randn(r, k, generator=g) / k ** 0.5).to(dtype)
    b_t = torch.randn(r, n, generator=g).to(dtype)
    y = torch.randn(tokens, n, generator=g).to(dtype)
    return rows, cols, x, a, b_t, y


def _masked(rows, cols, x, a, b_t, y):
    xa = (x.float() @ a.float().t()).to(a.dtype).float() * rows.mask(cols, torch.float32)
    return (y.float() + (xa @ b_t.float()).to(y.dtype).float()).to(y.dtype)


@pytest.mark.parametrize("tokens,k,n", [(16, 64, 96), (5, 40, 23), (33, 128, 17)])
def test_each_row_gets_its_own_adapters_product(tokens, k, n):
    rows, cols, x, a, b_t, y = _case(torch.float32, tokens, k, n)
    want = _masked(rows, cols, x, a, b_t, y)
    got = module.lora_rows_add_(y.clone(), x, a, b_t, rows.row_cols(cols))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base_rows = [i for i, s in enumerate(rows.slots) if s in (None, 1)]
    assert base_rows and torch.equal(got[base_rows], y[base_rows])  # rows with no columns here keep y
    adapted = [i for i in range(tokens) if i not in base_rows]
    assert (got[adapted] - y[adapted]).abs().min() > 0  # the adapters' rows do change


def test_bf16_rounds_as_the_masked_products_do():
    rows, cols, x, a, b_t, y = _case(torch.bfloat16, 16, 256, 160)
    got = module.lora_rows_add_(y.clone(), x, a, b_t, rows.row_cols(cols))
    want = _masked(rows, cols, x, a, b_t, y)
    # the same roundings (the product rounded to bf16, then its sum with y); fp32 sums in another order
    # can land one bf16 step apart
    assert (got.float() - want.float()).abs().max() <= 2 * 2.0 ** -8 * want.float().abs().max()
    assert (got != want).float().mean() < 0.05


def test_bad_arguments_are_refused():
    rows, cols, x, a, b_t, y = _case(torch.float32, 4, 32, 16)
    rc = rows.row_cols(cols)
    with pytest.raises(RuntimeError, match="one dtype"):
        module.lora_rows_add_(y.clone(), x.double(), a, b_t, rc)
    with pytest.raises(RuntimeError, match="out of"):
        module.lora_rows_add_(y.clone(), x, a, b_t, rc + torch.tensor([100, 0]))
    with pytest.raises(RuntimeError, match="a "):
        module.lora_rows_add_(y.clone(), x, a[:, :16].contiguous(), b_t, rc)
