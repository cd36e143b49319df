"""A whole run: the adapter PEFT loads unchanged (same logits as our forward with it), checkpoints,
resume to the same result as an uninterrupted run, the loss CSV, and bad data refused before training."""

import csv
import json

import pytest
import torch

from engine.finetune import DataError, LoRAConfig, TrainConfig, finetune
from engine.finetune.output import checkpoints

CONFIG = TrainConfig(max_length=48, batch_tokens=48, grad_accum=2, lr=5e-3, epochs=2, seed=3, save_every=2,
                     lora=LoRAConfig(r=4, alpha=8.0))


def _data(tmp_path, n=20):
    p = tmp_path / "train.jsonl"
    lines = []
    for i in range(n):
        lines.append({"messages": [{"role": "user", "content": f"question {i}?"},
                                   {"role": "assistant", "content": f"ANSWER: {i % 3} {i % 3} {i % 3}"}]})
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


def test_adapter_loads_in_peft_and_gives_our_logits(tmp_path, llama_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    data = _data(tmp_path)
    result = finetune(str(llama_dir), data, tmp_path / "out", CONFIG, eval_data=data, dtype="float32")
    out = tmp_path / "out"
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert result.eval_loss_after < result.eval_loss_before  # it learned the fixed answer format
    rows = list(csv.DictReader((out / "loss.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, result.steps + 1))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32), out)
    merged = model.merge_and_unload()
    ids = torch.tensor([[5, 17, 99, 3, 250, 42, 7]])
    ours = _our_logits(llama_dir, out, ids[0])
    torch.testing.assert_close(ours, merged(input_ids=ids).logits[0].float(), atol=1e-4, rtol=1e-4)
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)(input_ids=ids).logits[0]
    assert (ours - base).abs().max() > 1e-3  # the adapter changes the model


def _our_logits(folder, adapter_dir, ids):
    from engine.finetune import LoRATuner, load_adapter_weights
    from engine.finetune.batch import Example
    from engine.finetune.step import forward_loss  # noqa: F401 - the same forward the trainer runs
    from engine import model as M
    from engine.finetune.batch import build_micro_batch, scratch_kv

    with LoRATuner(str(folder), CONFIG, dtype="float32") as tuner:
        load_adapter_weights(adapter_dir, tuner.adapter)
        weights, cfg = tuner.base.weights, tuner.cfg
        weights.set_visit_order(list(range(cfg.num_layers)))
        batch = build_micro_batch([Example(tuple(ids.tolist()), (True,) * len(ids))], cfg, torch.float32,
                                  torch.device("cpu"))
        with torch.no_grad():
            x = weights.globals.embed(batch.steps[0].input_ids)
            for i in range(cfg.num_layers):
                x = M.block_forward(x, tuner.adapter.adapt(i, weights.acquire(i)),
                                    *scratch_kv(batch, cfg, torch.float32, torch.device("cpu")), batch.steps[i], cfg)
                weights.release(i)
            step = batch.steps[0]
            step = type("S", (), {"logits_index": torch.arange(len(ids))})()
            return M.final_logits(x, weights.globals.norm, weights.globals.head, step, cfg)


def test_interrupted_run_resumes_to_the_same_adapter(tmp_path, llama_dir):
    from safetensors.torch import load_file

    data = _data(tmp_path)
    whole = finetune(str(llama_dir), data, tmp_path / "whole", CONFIG, dtype="float32")

    def stop_at_5(step, _res):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        finetune(str(llama_dir), data, tmp_path / "cut", CONFIG, dtype="float32", on_step=stop_at_5)
    cut = tmp_path / "cut"
    assert not (cut / "adapter_model.safetensors").exists()  # nothing half-trained written as finished
    assert [p.name for p in checkpoints(cut)] == ["checkpoint-2", "checkpoint-4"]
    assert not list(cut.glob(".*tmp*"))
    resumed = finetune(str(llama_dir), data, cut, CONFIG, dtype="float32")
    assert resumed.resumed_from == 4
    a, b = load_file(cut / "adapter_model.safetensors"), load_file(tmp_path / "whole" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0, msg=k)
    assert resumed.losses == pytest.approx(whole.losses[4:], abs=1e-6)
    rows = list(csv.DictReader((cut / "loss.csv").open()))
    assert [int(r["step"]) for r in rows] == list(range(1, whole.steps + 1))


def test_resume_with_other_settings_is_refused(tmp_path, llama_dir):
    data = _data(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        finetune(str(llama_dir), data, tmp_path / "o", CONFIG, dtype="float32",
                 on_step=lambda s, _r: (_ for _ in ()).throw(KeyboardInterrupt) if s == 2 else None)
    other = TrainConfig(**{**CONFIG.__dict__, "lr": 1e-3})
    with pytest.raises(ValueError, match="other settings or data"):
        finetune(str(llama_dir), data, tmp_path / "o", other, dtype="float32")


def test_bad_data_is_refused_before_the_model_loads(tmp_path, llama_dir):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "fine"}\n{"text": 3}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: "):
        finetune(str(llama_dir), p, tmp_path / "out", CONFIG, dtype="float32")
    assert not (tmp_path / "out").exists()
