"""PEFT + transformers as the fine-tuning reference: the same adapter on the same base and batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.finetune import Example, LoRAConfig


def random_adapter(tuner, seed: int = 1) -> None:
    """Give the tuner's adapter random A and B (B is zero at init, which would leave A's gradient zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for a, b in tuner.adapter.params.values():
            a.copy_(torch.randn(a.shape, generator=gen) * 0.1)
            b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def peft_model(folder, lora: LoRAConfig, state: dict[str, torch.Tensor]):
    """transformers' fp32 model with PEFT's LoRA on lora.target_modules, holding `state` (PEFT keys)."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                            target_modules=list(lora.target_modules)))
    result = set_peft_model_state_dict(model, {k.replace(".weight", ".weight"): v for k, v in state.items()})
    assert not [k for k in result.unexpected_keys if "lora" in k]
    return model


def peft_loss(model, micro_batches: list[list[Example]]) -> torch.Tensor:
    """The mean cross-entropy over every trained target of every example, each example run alone."""
    targets = sum(e.targets for mb in micro_batches for e in mb)
    total = 0
    for mb in micro_batches:
        for e in mb:
            ids = torch.tensor([e.ids])
            logits = model(input_ids=ids).logits[0, :-1].float()  # (len - 1, vocab)
            mask = torch.tensor(e.trained[1:])
            total = total + F.cross_entropy(logits[mask], ids[0, 1:][mask], reduction="sum")
    return total / targets


def peft_grads(model) -> dict[str, torch.Tensor]:
    """name (PEFT's state-dict key) -> gradient, of every LoRA tensor."""
    out = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            out[name.replace(".default", "")] = p.grad.detach().clone()
    return out


def random_examples(n: int, vocab: int, seed: int, lo: int = 5, hi: int = 24) -> list[Example]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi, (1,), generator=gen))
        ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
        prompt = int(torch.randint(1, length - 2, (1,), generator=gen))
        out.append(Example(tuple(ids), tuple([False] * prompt + [True] * (length - prompt))))
    return out


def build_gemma2(folder):
    """A tiny Gemma 2 (sandwich norms, 1 + w norms, embedding scale, attention and final soft-caps, sliding
    windows on alternate layers): the block math furthest from Llama's."""
    from transformers import Gemma2Config

    from engine.demo import build_random_model

    cfg = Gemma2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                       sliding_window=8, query_pre_attn_scalar=24, architectures=["Gemma2ForCausalLM"])
    return build_random_model(folder, cfg, dtype=torch.float32, seed=11)


def training_budget(folder, config, resident: int = 1, **engine_args) -> int:
    """A device budget under which training keeps exactly `resident` blocks of the base resident: the
    inference plan's budget for that (limits of one sequence of max_length, steps of batch_tokens) plus
    what training takes out of it first."""
    from engine.finetune import training_footprint
    from tests.support.reference import budget_for

    base = budget_for(folder, resident=resident, max_model_len=config.max_length, max_num_seqs=1,
                      max_num_batched_tokens=config.batch_tokens, enable_prefix_caching=False, **engine_args)
    return base + training_footprint(str(folder), config, dtype="float32", **engine_args).device_bytes
