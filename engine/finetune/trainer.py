"""A whole fine-tuning run: data -> steps -> checkpoints -> the final adapter, resumable.

The run is deterministic from its settings: each epoch's order comes from (seed, epoch), so a resumed
run continues from its checkpoint's (epoch, step in epoch) with the adapter and AdamW's moments it saved
and trains exactly the steps the uninterrupted run would have.
"""

from __future__ import annotations

import csv
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .config import TrainConfig
from .data import Dataset, epoch_steps, load_jsonl
from .output import (TrainerState, checkpoints, config_record, load_adapter_weights, load_checkpoint,
                     save_adapter, save_checkpoint)
from .tuner import LoRATuner, StepResult

log = logging.getLogger("layerstream")

LOSS_CSV = "loss.csv"
CSV_FIELDS = ["step", "epoch", "loss", "lr", "targets", "tokens", "seconds", "tokens_per_s"]


@dataclass
class FineTuneResult:
    adapter: Path  # the folder holding adapter_config.json + adapter_model.safetensors
    steps: int
    losses: list[float] = field(default_factory=list)  # this run's step losses (a resumed run: from the resume on)
    eval_loss_before: float | None = None
    eval_loss_after: float | None = None
    resumed_from: int | None = None  # the checkpoint's step


def _data_id(path: str) -> str:
    p = Path(path)
    return f"{p.resolve()}:{p.stat().st_size}"


def finetune(model: str, data: str | Path, output: str | Path, config: TrainConfig | None = None, *,
             eval_data: str | Path | None = None, resume: bool = True, progress: bool = False,
             on_step: Callable[[int, StepResult], None] | None = None, **engine_args) -> FineTuneResult:
    """Train a LoRA adapter for `model` on the JSONL file `data`; the adapter is written to `output` (PEFT's
    format) when training finishes, checkpoints to output/checkpoint-<step> every config.save_every steps.
    resume: continue from the newest checkpoint in output when there is one (its settings and data must
    match). eval_data: a JSONL file whose mean loss is measured before and after. engine_args: EngineArgs
    fields for the base (device, dtype, max_device_memory, transport, ...)."""
    from ..llm_engine import load_tokenizer
    from ..model_source import resolve_model

    config = config or TrainConfig()
    output = Path(output)
    tokenizer = load_tokenizer(resolve_model(model))
    dataset = load_jsonl(data, tokenizer, config.max_length)  # every line checked before the model loads
    evalset = load_jsonl(eval_data, tokenizer, config.max_length) if eval_data else None
    if dataset.cut:
        log.warning("%d of %d examples are longer than max_length %d and were cut", dataset.cut,
                    len(dataset.examples), config.max_length)
    per_epoch = len(epoch_steps(dataset.examples, config, 0))
    total = per_epoch * config.epochs if config.max_steps is None else min(config.max_steps, per_epoch * config.epochs)
    tuner = LoRATuner(model, config, **engine_args)
    try:
        log.info("fine-tuning %s: %d examples, %d trained tokens, %d steps (%d an epoch), LoRA r=%d on %s\n%s",
                 model, len(dataset.examples), dataset.targets, total, per_epoch, config.lora.r,
                 ", ".join(config.lora.target_modules), tuner.memory.describe())
        return _train(tuner, model, dataset, evalset, output, config, total, per_epoch, resume, progress, on_step)
    finally:
        tuner.close()


def _train(tuner: LoRATuner, model: str, dataset: Dataset, evalset: Dataset | None, output: Path,
           config: TrainConfig, total: int, per_epoch: int, resume: bool, progress: bool, on_step) -> FineTuneResult:
    from tqdm.auto import tqdm

    record = config_record(config)
    step, epoch, epoch_step, resumed = 0, 0, 0, None
    found = checkpoints(output) if resume else []
    if found:
        state, opt_state = load_checkpoint(found[-1])
        if state.config != record or state.data != _data_id(dataset.path):
            raise ValueError(f"{found[-1]} was trained with other settings or data; pass another output folder "
                             "or resume=False (--no-resume) to start over")
        load_adapter_weights(found[-1], tuner.adapter)
        tuner.optimizer.load_state_dict(opt_state)
        step, epoch, epoch_step, resumed = state.step, state.epoch, state.epoch_step, state.step
        log.info("resuming from %s (step %d)", found[-1], step)
    evaluate = (lambda: tuner.evaluate([mb for s in epoch_steps(evalset.examples, config, 0) for mb in s])) \
        if evalset else (lambda: None)
    result = FineTuneResult(output, total, resumed_from=resumed, eval_loss_before=evaluate())
    output.mkdir(parents=True, exist_ok=True)
    csv_path = output / LOSS_CSV
    rows = _kept_rows(csv_path, step) if resumed else []
    bar = tqdm(total=total, initial=step, desc="fine-tuning", unit="step", disable=not progress)
    try:
        with csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
            writer.writeheader()
            writer.writerows(rows)
            while step < total:
                steps = epoch_steps(dataset.examples, config, epoch)
                if epoch_step >= len(steps):
                    epoch, epoch_step = epoch + 1, 0
                    continue
                t0 = time.perf_counter()
                res = tuner.step(steps[epoch_step])
                seconds = time.perf_counter() - t0
                if not math.isfinite(res.loss):
                    raise FloatingPointError(f"step {step + 1}: the loss is {res.loss}; lower the learning rate "
                                             f"(--lr {config.lr})")
                step, epoch_step = step + 1, epoch_step + 1
                result.losses.append(res.loss)
                writer.writerow({"step": step, "epoch": epoch, "loss": f"{res.loss:.6f}", "lr": config.lr,
                                 "targets": res.targets, "tokens": res.tokens, "seconds": f"{seconds:.3f}",
                                 "tokens_per_s": f"{res.tokens / seconds:.1f}"})
                f.flush()
                bar.set_postfix(loss=f"{res.loss:.4f}", tok_s=f"{res.tokens / seconds:.0f}", epoch=epoch)
                bar.update(1)
                if config.save_every and step % config.save_every == 0 and step < total:
                    save_checkpoint(output, TrainerState(step, epoch, epoch_step, _data_id(dataset.path), record),
                                    tuner.adapter, tuner.optimizer.state_dict(), model)
                if on_step:
                    on_step(step, res)
    finally:
        bar.close()
    save_adapter(output, tuner.adapter, model)
    result.eval_loss_after = evaluate()
    _plot(csv_path)
    return result


def _kept_rows(csv_path: Path, step: int) -> list[dict]:
    """The loss rows of steps up to a resumed checkpoint's (later rows belong to the interrupted run)."""
    if not csv_path.is_file():
        return []
    with csv_path.open(newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= step]


def _plot(csv_path: Path) -> None:
    """loss.png beside loss.csv, where matplotlib is installed (the bench extra); the CSV is the record."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([int(r["step"]) for r in rows], [float(r["loss"]) for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    fig.tight_layout()
    fig.savefig(csv_path.with_suffix(".png"), dpi=100)
    plt.close(fig)
