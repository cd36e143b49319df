"""AdamW with its moments in host memory and its step on the CPU (optimizer-state offload).

The adapter's tensors and gradients live on the compute device; the optimizer keeps fp32 master copies
on the host, takes the gradients there, steps torch.optim.AdamW over the copies, and copies the updated
values back. On the CPU the device is the host: the adapter's own tensors are the masters, no copy.
"""

from __future__ import annotations

import torch

from .lora import LoRAAdapter


class HostAdamW:
    def __init__(self, adapter: LoRAAdapter, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float):
        self.device_params = adapter.tensors()
        self.on_host = all(p.device.type == "cpu" for p in self.device_params)
        if self.on_host:
            self.masters = self.device_params
        else:
            # pinned: the gradients' copies down and the weights' copies up run without a host sync
            self.masters = [p.detach().to("cpu").pin_memory().requires_grad_() for p in self.device_params]
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def step(self, lr: float | None = None) -> None:
        """One AdamW step from the gradients on the adapter's tensors, then zero them."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if not self.on_host:
            for m, p in zip(self.masters, self.device_params):
                m.grad = p.grad.to("cpu", non_blocking=True) if p.grad is not None else None
            torch.cuda.synchronize()
        self.optimizer.step()
        if not self.on_host:
            with torch.no_grad():
                for m, p in zip(self.masters, self.device_params):
                    p.copy_(m, non_blocking=True)  # ordered before the next step's kernels on the same stream
        for p in self.device_params:
            p.grad = None
        for m in self.masters:
            m.grad = None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)
        if not self.on_host:
            with torch.no_grad():
                for m, p in zip(self.masters, self.device_params):
                    m.copy_(p)
