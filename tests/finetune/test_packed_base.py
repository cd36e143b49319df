"""A packed base (GGUF, int4/int8): its products get a backward through the dequantized weight, so LoRA
trains over it QLoRA-style."""

import pytest
import torch

from engine import ops
from engine.finetune import LoRAConfig, LoRATuner, TrainConfig
from gguf import GGMLQuantizationType as Q

from engine.weights import Int8Weight
from tests.support.finetune import random_examples
from tests.support.gguf_models import tiny_gguf


def test_packed_product_backward_is_the_dequantized_weights():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=gen)
    packed, tol = Int8Weight.quantize(w, torch.float32), 0.02
    x = torch.randn(5, 128, generator=gen, requires_grad=True)
    g = torch.randn(5, 96, generator=gen)
    y = ops.linear(x, packed)
    assert y.requires_grad
    y.backward(g)
    expected = g @ w  # the unquantized weight: equal up to the quantization's error
    err = (x.grad - expected).norm() / expected.norm()
    assert err < tol, err
    with torch.no_grad():  # and the forward is still the kernel's own product
        torch.testing.assert_close(y.detach(), ops.linear(x.detach(), packed))


@pytest.mark.parametrize("qtype,kind", [(Q.Q8_0, "int8"), (Q.Q4_0, "int4")])
def test_lora_trains_over_a_gguf_base(tmp_path, qtype, kind):
    path = tiny_gguf(tmp_path, "llama", qtype)
    config = TrainConfig(max_length=32, batch_tokens=64, lr=1e-2, lora=LoRAConfig(r=4, alpha=8.0))
    batch = [random_examples(3, 512, seed=4)]
    with LoRATuner(str(path), config, dtype="bfloat16") as tuner:
        w = tuner.base.weights.acquire(0)
        assert kind in {getattr(v, "kind", None) for v in w.values()}  # the products are the packed kernels'
        tuner.base.weights.reset()
        losses = [tuner.step(batch).loss for _ in range(8)]
        grads_live = all(t.grad is None for t in tuner.adapter.tensors())  # zeroed after each step
    assert grads_live
    assert losses[-1] < losses[0] - 0.1, losses  # it learns the batch
