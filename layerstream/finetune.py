"""`layerstream finetune MODEL --data train.jsonl --output adapter/`: train a LoRA adapter over a frozen
base that streams through the same weights package as inference (engine.finetune).

    layerstream finetune demo --data chats.jsonl --output my-adapter --epochs 3
    layerstream finetune ./llama-3b --data chats.jsonl --output out --max-device-memory 2GiB --dtype bfloat16

The adapter (adapter_config.json + adapter_model.safetensors, PEFT's format) is written to --output when
training finishes; checkpoints go to --output/checkpoint-<step> every --save-every steps, and running the
same command again resumes from the newest. loss.csv (and loss.png with matplotlib) record the curve.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.args import EngineArgs
    from engine.cli import MODEL_HELP, add_model_argument, add_placement_arguments
    from engine.finetune import LoRAConfig, TrainConfig
    from engine.finetune.config import TARGETS

    t, lora, d = TrainConfig(), LoRAConfig(), EngineArgs.default
    p.usage = "%(prog)s MODEL --data FILE --output DIR [options]"
    add_model_argument(p, default="demo", help=f"the base: {MODEL_HELP}, or demo (the built-in small model)")
    p.add_argument("--data", required=True, help='JSONL training file: {"messages": [...]} lines (chat; the loss on '
                   'assistant turns only) or {"text": ...} lines')
    p.add_argument("--eval-data", default=None, help="JSONL file whose mean loss is printed before and after")
    p.add_argument("--output", required=True, help="folder for the adapter, checkpoints and loss.csv")
    g = p.add_argument_group("training")
    g.add_argument("--epochs", type=int, default=t.epochs, help=f"passes over the data (default: {t.epochs})")
    g.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    g.add_argument("--lr", type=float, default=t.lr, help=f"AdamW learning rate (default: {t.lr})")
    g.add_argument("--weight-decay", type=float, default=t.weight_decay,
                   help=f"AdamW weight decay (default: {t.weight_decay})")
    g.add_argument("--max-length", type=int, default=t.max_length,
                   help=f"tokens of one example; longer ones are cut (default: {t.max_length})")
    g.add_argument("--batch-tokens", type=int, default=t.batch_tokens,
                   help=f"tokens of one micro-batch, examples packed whole (default: {t.batch_tokens})")
    g.add_argument("--grad-accum", type=int, default=t.grad_accum,
                   help=f"micro-batches per optimizer step (default: {t.grad_accum})")
    g.add_argument("--no-packing", dest="packing", action="store_false",
                   help="one example per micro-batch instead of several packed (each still attends only to itself)")
    g.add_argument("--seed", type=int, default=t.seed, help=f"shuffle and adapter init seed (default: {t.seed})")
    g.add_argument("--save-every", type=int, default=t.save_every,
                   help="optimizer steps between checkpoints (default: 0, only the final adapter)")
    g.add_argument("--no-resume", dest="resume", action="store_false",
                   help="start over even when --output holds checkpoints")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.add_argument_group("adapter")
    a.add_argument("--lora-r", type=int, default=lora.r, help=f"LoRA rank (default: {lora.r})")
    a.add_argument("--lora-alpha", type=float, default=lora.alpha,
                   help=f"LoRA alpha; the update is scaled by alpha / r (default: {lora.alpha:g})")
    a.add_argument("--lora-targets", default=",".join(lora.target_modules),
                   help=f"comma-separated projections to adapt, of {', '.join(TARGETS)} (default: all)")
    e = p.add_argument_group("base model")
    add_placement_arguments(e, "device memory budget for the base's weights, e.g. 4GiB; what does not fit streams")
    e.add_argument("--prefetch-depth", type=int, default=d("prefetch_depth"), help="streamed blocks prepared ahead")
    e.add_argument("--transport", default=d("transport"), help="auto, cpu, cuda, disk (as `generate --transport`)")


# The base model's flags, passed on as EngineArgs fields of the same names.
BASE_FLAGS = ("device", "dtype", "max_device_memory", "max_host_memory", "prefetch_depth", "transport")


def run(ns: argparse.Namespace) -> int:
    from engine.finetune import LoRAConfig, TrainConfig, finetune

    lora = LoRAConfig(r=ns.lora_r, alpha=ns.lora_alpha,
                      target_modules=tuple(m.strip() for m in ns.lora_targets.split(",") if m.strip()))
    config = TrainConfig(lr=ns.lr, weight_decay=ns.weight_decay, epochs=ns.epochs, max_steps=ns.max_steps,
                         max_length=ns.max_length, batch_tokens=ns.batch_tokens, grad_accum=ns.grad_accum,
                         packing=ns.packing, seed=ns.seed, save_every=ns.save_every, lora=lora)
    result = finetune(ns.model, ns.data, ns.output, config, eval_data=ns.eval_data, resume=ns.resume,
                      progress=not ns.no_progress, **{k: vars(ns)[k] for k in BASE_FLAGS})
    if result.resumed_from is not None:
        print(f"resumed from step {result.resumed_from}")
    if result.losses:
        print(f"trained {result.steps} steps; last loss {result.losses[-1]:.4f}")
    if result.eval_loss_before is not None:
        print(f"eval loss {result.eval_loss_before:.4f} -> {result.eval_loss_after:.4f}")
    print(f"adapter: {result.adapter}")
    return 0
