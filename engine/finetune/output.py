"""What a run writes: the adapter in PEFT's format (adapter_config.json + adapter_model.safetensors, which
peft's PeftModel.from_pretrained loads unchanged), checkpoints every N steps, and the loss curve.

Every folder is written beside its final name and renamed into place, so a crash leaves either the old
folder or the new one, never half of one. The final adapter is written only when training finished:
an interrupted run leaves checkpoints (checkpoint-<step>/, the last KEEP of them), from which it resumes.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .config import TrainConfig
from .lora import LoRAAdapter

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
STATE, OPTIMIZER = "trainer_state.json", "optimizer.pt"
KEEP = 2  # checkpoints kept: the newest, and the one before in case the newest is on a failing disk


def adapter_config(adapter: LoRAAdapter, base_model: str) -> dict:
    c = adapter.config
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": c.r, "lora_alpha": c.alpha, "lora_dropout": 0.0, "target_modules": sorted(c.target_modules),
            "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "layers_to_transform": None,
            "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}, "revision": None}


def write_atomically(folder: Path, fill) -> None:
    """fill(tmp) writes a folder's files into tmp; tmp then replaces folder in one rename (and the
    previous folder, if any, is removed after)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    old = folder.with_name(f".{folder.name}.old-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        fill(tmp)
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not folder.exists():
            old.rename(folder)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _write_adapter(folder: Path, adapter: LoRAAdapter, base_model: str) -> None:
    (folder / ADAPTER_CONFIG).write_text(json.dumps(adapter_config(adapter, base_model), indent=2) + "\n")
    save_file(adapter.state_dict(), str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def save_adapter(folder: str | Path, adapter: LoRAAdapter, base_model: str) -> Path:
    """The adapter alone, PEFT's format, in `folder` (its two files replaced atomically together)."""
    folder = Path(folder)
    # The two files go into a fresh subfolder renamed into place, then beside any other files of folder.
    stage = folder / ".adapter"
    write_atomically(stage, lambda tmp: _write_adapter(tmp, adapter, base_model))
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        os.replace(stage / name, folder / name)
    stage.rmdir()
    return folder


def load_adapter_weights(folder: str | Path, adapter: LoRAAdapter) -> None:
    """An adapter folder's weights into `adapter`; its r, alpha and targets must be the adapter's."""
    folder = Path(folder)
    cfg = json.loads((folder / ADAPTER_CONFIG).read_text())
    c = adapter.config
    if (cfg.get("r"), float(cfg.get("lora_alpha")), sorted(cfg.get("target_modules") or [])) != \
            (c.r, float(c.alpha), sorted(c.target_modules)):
        raise ValueError(f"{folder}: adapter r={cfg.get('r')} alpha={cfg.get('lora_alpha')} targets "
                         f"{cfg.get('target_modules')} differ from this run's r={c.r} alpha={c.alpha} "
                         f"targets {list(c.target_modules)}")
    adapter.load_state_dict(load_file(str(folder / ADAPTER_WEIGHTS)))


@dataclass(frozen=True)
class TrainerState:
    """Where a run is: optimizer steps done, and the epoch and step within it to continue from."""

    step: int
    epoch: int
    epoch_step: int
    data: str  # the training file and its size: resuming on other data is refused
    config: dict  # the TrainConfig's fields (resuming with other settings is refused)


def config_record(config: TrainConfig) -> dict:
    """The settings a resume must share (save_every and max_steps may change between runs)."""
    d = asdict(config)
    for free in ("save_every", "max_steps", "epochs"):
        d.pop(free)
    return json.loads(json.dumps(d))


def save_checkpoint(output: Path, state: TrainerState, adapter: LoRAAdapter, optimizer_state: dict,
                    base_model: str) -> Path:
    folder = Path(output) / f"checkpoint-{state.step}"

    def fill(tmp: Path) -> None:
        _write_adapter(tmp, adapter, base_model)
        torch.save(optimizer_state, tmp / OPTIMIZER)
        (tmp / STATE).write_text(json.dumps(asdict(state), indent=2) + "\n")  # last: it marks the folder complete

    write_atomically(folder, fill)
    for old in checkpoints(output)[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)
    return folder


def checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints in output, oldest first."""
    found = [p for p in Path(output).glob("checkpoint-*") if (p / STATE).is_file() and p.name[11:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[11:]))


def load_checkpoint(folder: Path) -> tuple[TrainerState, dict]:
    """(state, optimizer state dict) of a checkpoint folder; the adapter: load_adapter_weights(folder)."""
    state = TrainerState(**json.loads((folder / STATE).read_text()))
    return state, torch.load(folder / OPTIMIZER, weights_only=True)
