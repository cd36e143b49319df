"""PEFT adapters for serving tests: written by PEFT itself (save_pretrained) with random A and B, and PEFT's
merged model as the reference."""

from __future__ import annotations

from pathlib import Path

import torch


def make_adapter(folder: Path, base: Path, r: int = 4, alpha: float = 8.0, targets=("q_proj", "k_proj", "v_proj",
                 "o_proj", "gate_proj", "up_proj", "down_proj"), seed: int = 0, std: float = 0.1,
                 use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter over `base` in `folder`, A and B drawn from N(0, std^2) (PEFT starts B at zero,
    which would make the adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                           LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets),
                                      use_rslora=use_rslora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(folder)
    return Path(folder)


def merged_logits(base: Path, adapter: Path | None, ids: list[int]) -> torch.Tensor:
    """fp32 logits (vocab,) after `ids` of PEFT's merged model (merge_and_unload), or of the base alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()
