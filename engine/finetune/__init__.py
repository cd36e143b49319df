"""Fine-tuning: LoRA adapters trained over a frozen base that streams through the weights package.

Public interface (callers import only this module):
  TrainConfig, LoRAConfig       what to train and how (validated at construction; ValueError names the value)
  LoRATuner(model, config, **engine_args)
      The base opened for training (engine_args: EngineArgs fields: device, dtype, max_device_memory, ...),
      the adapter on the device, AdamW's moments on the host. .step(micro_batches) -> StepResult;
      .accumulate(micro_batches) (gradients only); .adapter; .plan; .memory; .close().
      max_device_memory bounds the base and training together: training's device share comes out first.
  training_footprint(model, config, **engine_args) -> TrainingMemory
      What training adds and where (device: adapter, gradients, one block's backward; host: AdamW state,
      checkpoints), from the checkpoint's headers.
  finetune(model, data, output, config, eval_data=, resume=, progress=, **engine_args) -> FineTuneResult
      A whole run: JSONL data (data.py: chat or text; DataError names a bad line before the model loads),
      checkpoints every config.save_every steps (atomic; the newest resumes), the PEFT-format adapter in
      `output` when training finished, loss.csv (and loss.png with matplotlib).
  save_adapter(folder, adapter, base_model), load_adapter_weights(folder, adapter)
  DataError, Example            a bad training line; one tokenized example (ids, which tokens are trained)
"""

from .batch import Example
from .config import LoRAConfig, TrainConfig
from .data import DataError
from .lora import LoRAAdapter, LoRAWeight
from .output import load_adapter_weights, save_adapter
from .trainer import FineTuneResult, finetune
from .memory import TrainingMemory
from .tuner import LoRATuner, StepResult, training_footprint

__all__ = ["DataError", "Example", "FineTuneResult", "LoRAAdapter", "LoRAConfig", "LoRATuner", "LoRAWeight",
           "StepResult", "TrainConfig", "TrainingMemory", "finetune", "load_adapter_weights", "save_adapter",
           "training_footprint"]
