"""What a failure inside a step means: a request's own, which ends that request alone (finish_reason
"error"), or the engine's, which no retry can mend (EngineUnhealthyError: stop serving, go not-ready)."""

from __future__ import annotations

import torch


class EngineUnhealthyError(RuntimeError):
    """The engine's state can no longer be trusted (a fatal device error such as a CUDA
    device-side assert, or steps that fail whatever runs in them): stop serving, go not-ready."""


def is_fatal_device_error(error: BaseException) -> bool:
    """Whether an exception (or one it was raised from) leaves the device unusable: after a CUDA
    device-side assert or illegal access every later CUDA call fails, so nothing can be retried.
    An out-of-memory error is not fatal."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    seen = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if accelerator_error is not None and isinstance(e, accelerator_error):
            return True
        text = str(e)
        if "CUDA error" in text or "device-side assert" in text or "illegal memory access" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def raise_if_fatal(error: BaseException) -> None:
    """EngineUnhealthyError from `error` when it left the device unusable; otherwise nothing."""
    if is_fatal_device_error(error):
        raise EngineUnhealthyError(f"fatal device error: {type(error).__name__}") from error
