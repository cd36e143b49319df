"""`layerstream finetune`: an adapter and the loss CSV from the command line; a bad line is one clear error."""

import json

from layerstream.cli import main


def test_finetune_command_writes_adapter_and_loss_csv(tmp_path, llama_dir, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} says hello"}) + "\n" for i in range(6)))
    out = tmp_path / "out"
    rc = main(["finetune", str(llama_dir), "--data", str(data), "--output", str(out), "--dtype", "float32",
               "--max-length", "32", "--batch-tokens", "32", "--lora-r", "2", "--lora-targets", "q_proj,v_proj",
               "--no-progress", "--eval-data", str(data)])
    assert rc == 0
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and cfg["target_modules"] == ["q_proj", "v_proj"] and cfg["peft_type"] == "LORA"
    lines = (out / "loss.csv").read_text().splitlines()
    assert lines[0].startswith("step,epoch,loss") and len(lines) > 2
    printed = capsys.readouterr().out
    assert "eval loss" in printed and f"adapter: {out}" in printed


def test_finetune_command_names_a_bad_line(tmp_path, llama_dir, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "ok"}\n{"messages": "nope"}\n')
    rc = main(["finetune", str(llama_dir), "--data", str(data), "--output", str(tmp_path / "o"), "--no-progress"])
    assert rc == 2
    assert "d.jsonl:2: \"messages\" must be a non-empty list" in capsys.readouterr().err


def test_unknown_lora_target_is_refused(tmp_path, llama_dir, capsys):
    rc = main(["finetune", str(llama_dir), "--data", str(tmp_path / "x.jsonl"), "--output", str(tmp_path / "o"),
               "--lora-targets", "q_proj,qkv"])
    assert rc == 2 and "unknown LoRA target modules ['qkv']" in capsys.readouterr().err


def test_python_api_beside_llm(tmp_path, llama_dir):
    import engine

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(3)))
    config = engine.TrainConfig(max_length=32, batch_tokens=32, epochs=3, max_steps=2, lora=engine.LoRAConfig(r=2, alpha=4))
    result = engine.train_lora(str(llama_dir), data, tmp_path / "out", config, dtype="float32")
    assert result.steps == 2 and len(result.losses) == 2
    assert (tmp_path / "out" / "adapter_model.safetensors").is_file()
