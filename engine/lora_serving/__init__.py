"""Serving LoRA adapters: several PEFT adapters over one base model, in the same batched steps.

Public interface (callers import only this module):
  parse_lora_modules(value) -> {name: path}
      --lora-modules / EngineArgs.lora_modules: "name=path" specs (or vLLM's JSON objects), or a dict.
  read_adapter(folder, cfg) -> AdapterWeights
      A PEFT adapter folder checked against the model (LoRAAdapterError names the folder and what is wrong:
      missing files, a target module the model does not have, a rank that disagrees with the weights, a
      corrupt safetensors file, DoRA or other settings the product does not compute). Touches no engine
      state: call it off the engine thread.
  check_servable(cfg)       LoRAAdapterError for a model whose projections cannot be adapted when served.
  AdapterSet(cfg, device)   the adapters an engine serves, owned and changed on the engine thread:
      .add(name, weights) -> ServedAdapter (its slot, digest); .remove(name); .get(name) (UnknownAdapterError);
      .served(); .adapt(layer, w, rows) -> block weights with each targeted projection a RowLoRAWeight.
  LoRARows.of(slots per token, device) -> LoRARows | None
      Each token's adapter for a step (None: no row has one); the runner puts it in StepInputs.lora.
  RowLoRAWeight  the data engine.ops multiplies: one base product for every row, and each row's own adapter's
      low-rank product (x A^T B^T * scale, fp32 as PEFT computes it; a stacked q/k/v or gate/up weight's
      segments as one stacked A and one block-diagonal B, kept transposed, the scale folded into B): row by
      row through its adapter's columns (LoRARows.row_cols) on the CPU for few rows, else the adapters side by
      side, masked (LoRARows.mask) so that each row adds its own adapter's only.

The math: a projection y = x W^T over the step's rows gains, on the rows of adapter s only,
scale_s * (x A_s^T) B_s^T. Rows of the base alone get nothing added. The fused C++ decode block has no
adapter term: a step with any adapted row runs its blocks op by op (engine.ops.fused_block).
"""

from .adapter_file import AdapterWeights, LoRAAdapterError, check_servable, read_adapter
from .adapter_set import AdapterSet, ServedAdapter, UnknownAdapterError
from .modules import parse_lora_modules
from .rows import LoRARows, RowLoRAWeight

__all__ = ["AdapterSet", "AdapterWeights", "LoRAAdapterError", "LoRARows", "RowLoRAWeight",
           "ServedAdapter", "UnknownAdapterError", "check_servable", "parse_lora_modules", "read_adapter"]
