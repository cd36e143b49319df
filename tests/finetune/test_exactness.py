"""LoRA training over the streamed base against PEFT + transformers on the same fp32 checkpoint."""

import pytest
import torch

from engine.finetune import LoRAConfig, LoRATuner, TrainConfig
from tests.support.finetune import training_budget, build_gemma2, peft_grads, peft_loss, peft_model, random_adapter, random_examples

LORA = LoRAConfig(r=4, alpha=8.0)


def _tuner(folder, streamed: bool, **kw) -> LoRATuner:
    config = TrainConfig(max_length=32, batch_tokens=64, lora=kw.pop("lora", LORA), **kw)
    budget = training_budget(folder, config) if streamed else None
    return LoRATuner(str(folder), config, dtype="float32", max_device_memory=budget)


@pytest.mark.parametrize("arch,streamed", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False),
                                           ("mistral", True), ("gemma2", True)])
def test_one_step_gradients_match_peft(model_dirs, tmp_path, arch, streamed):
    folder = build_gemma2(tmp_path / arch) if arch == "gemma2" else model_dirs[arch]
    with _tuner(folder, streamed) as tuner:
        assert bool(tuner.plan.streamed_blocks) == streamed
        assert tuner.memory.adapter_bytes == sum(4 * t.numel() for t in tuner.adapter.tensors())
        assert tuner.memory.optimizer_bytes == 2 * tuner.memory.adapter_bytes  # CPU: the adapter is the master
        random_adapter(tuner)
        batches = [random_examples(3, tuner.cfg.vocab_size, seed=2), random_examples(2, tuner.cfg.vocab_size, seed=3)]
        result = tuner.accumulate(batches)
        mine = {k: None for k in tuner.adapter.state_dict()}
        for (layer, module), (a, b) in tuner.adapter.params.items():
            prefix = next(k for k in mine if f"layers.{layer}." in k and f".{module}." in k).rsplit(".lora_", 1)[0]
            mine[prefix + ".lora_A.weight"], mine[prefix + ".lora_B.weight"] = a.grad, b.grad
        ref = peft_model(folder, LORA, tuner.adapter.state_dict())
        loss = peft_loss(ref, batches)
        loss.backward()
    assert result.loss == pytest.approx(loss.item(), rel=1e-5)
    grads = peft_grads(ref)
    assert set(grads) == set(mine)
    for k, g in grads.items():
        assert g.abs().max() > 0, k  # a test that could fail: every gradient is live
        torch.testing.assert_close(mine[k], g, atol=1e-5, rtol=1e-5, msg=k)


def test_ten_adamw_steps_match_peft(model_dirs):
    folder = model_dirs["llama"]
    lora = LoRAConfig(r=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"))
    steps = [[random_examples(2, 512, seed=10 + s)] for s in range(10)]
    with _tuner(folder, True, lora=lora, lr=1e-3, weight_decay=0.01) as tuner:
        start = tuner.adapter.state_dict()
        for batches in steps:
            tuner.step(batches)
        mine = tuner.adapter.state_dict()
    ref = peft_model(folder, lora, start)
    params = [p for n, p in ref.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for batches in steps:
        opt.zero_grad()
        peft_loss(ref, batches).backward()
        opt.step()
    from peft import get_peft_model_state_dict

    theirs = get_peft_model_state_dict(ref)
    assert set(theirs) == set(mine)
    moved = max((mine[k] - start[k]).abs().max().item() for k in mine)
    assert moved > 1e-3  # the adapter did train
    for k in mine:
        torch.testing.assert_close(mine[k], theirs[k], atol=1e-5, rtol=0, msg=k)


@pytest.mark.cuda
def test_streamed_gradients_on_cuda_match_peft(model_dirs):
    """The CUDA transport's streamed blocks, the adapter on the GPU, AdamW's masters on the host."""
    folder = model_dirs["llama"]
    config = TrainConfig(max_length=32, batch_tokens=64, lora=LORA)
    budget = training_budget(folder, config, device="cuda")
    with LoRATuner(str(folder), config, dtype="float32", device="cuda", max_device_memory=budget) as tuner:
        assert tuner.plan.streamed_blocks
        random_adapter(tuner)
        batches = [random_examples(3, tuner.cfg.vocab_size, seed=2)]
        tuner.accumulate(batches)
        state = tuner.adapter.state_dict()
        ref = peft_model(folder, LORA, state)
        peft_loss(ref, batches).backward()
    theirs = peft_grads(ref)
    mine = {}
    for (layer, module), (a, b) in tuner.adapter.params.items():
        key = next(k for k in state if f"layers.{layer}." in k and f".{module}." in k).rsplit(".lora_", 1)[0]
        mine[key + ".lora_A.weight"], mine[key + ".lora_B.weight"] = a.grad.cpu(), b.grad.cpu()
    for k, g in theirs.items():
        torch.testing.assert_close(mine[k], g, atol=1e-5, rtol=1e-5, msg=k)
