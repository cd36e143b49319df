"""Fine-tuning: LoRA adapters trained over a frozen base that streams through the weights package.

Public interface (callers import only this module):
  TrainConfig, LoRAConfig       what to train and how (validated at construction; ValueError names the value)
  LoRATuner(model, config, **engine_args)
      The base opened for training (engine_args: EngineArgs fields: device, dtype, max_device_memory, ...),
      the adapter on the device, AdamW's moments on the host. .step(micro_batches) -> StepResult;
      .accumulate(micro_batches) (gradients only); .adapter; .plan; .close().
  Example                       one tokenized example (ids, which tokens are trained)
"""

from .batch import Example
from .config import LoRAConfig, TrainConfig
from .lora import LoRAAdapter, LoRAWeight
from .tuner import LoRATuner, StepResult

__all__ = ["Example", "LoRAAdapter", "LoRAConfig", "LoRATuner", "LoRAWeight", "StepResult", "TrainConfig"]
