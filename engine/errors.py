"""Errors a user's input can cause while loading, shared by the config reader, the loader and the
weights package."""

from __future__ import annotations

import torch

from .planner import MemoryPlan, format_bytes


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is; the message names the file and the tensor."""


class UnsupportedModelError(ValueError):
    """An architecture (or a feature of one) layerstream does not run."""


class DeviceMemoryError(ValueError):
    """The device could not hold what the memory plan placed on it."""


def out_of_memory_error(plan: MemoryPlan | None, device: torch.device, err: BaseException) -> DeviceMemoryError:
    """A start-up OOM turned into one message that shows the plan that did not fit."""
    where = ""
    if device.type == "cuda":
        try:
            free, total = torch.cuda.mem_get_info(device)
            where = f" ({format_bytes(free)} free of {format_bytes(total)} now)"
        except Exception:  # noqa: BLE001 - the context may be unusable after an OOM; the plan matters more
            pass
    plan_text = plan.describe() if plan is not None else "(no plan was made yet)"
    return DeviceMemoryError(
        f"{device} ran out of memory while loading{where}: {str(err).splitlines()[0] if str(err) else err!r}\n"
        f"{plan_text}\nlower --max-device-memory (other processes or the CUDA context use part of the "
        "device), --max-model-len or --max-num-seqs")
