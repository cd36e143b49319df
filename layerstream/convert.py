"""`layerstream convert MODEL`: build a model's cache entry ahead of time, as its first load would.

A GGUF file's blocks are prepacked for the CPU kernels (engine/weights/packed/prepacked.py); with
--quantization int4|int8, a safetensors checkpoint's blocks are quantized (engine/weights/packed/quant_cache.py).
The entry goes under the layerstream cache ($LAYERSTREAM_CACHE), keyed by the model's files, the
compute dtype, torch's version and this CPU's kernel layout: convert on the machine (or in the image)
that serves, with the same --dtype and --quantization. The model's own folder is never written.

    layerstream convert model.Q4_K_M.gguf
    layerstream convert ./llama-3b --quantization int4
"""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engine.cli import add_model_argument

    p.usage = "%(prog)s MODEL [options]"
    add_model_argument(p, default=None, help="a GGUF file (or a folder holding one), or a safetensors folder with "
                       "--quantization; a hub id (org/name) is looked up in the local Hugging Face cache")
    p.add_argument("--dtype", default="auto",
                   help="compute dtype the entry is for, as `generate --dtype` (default: auto)")
    p.add_argument("--quantization", choices=("int8", "int4"), default=None,
                   help="quantize a bf16/fp16/fp32 safetensors checkpoint's blocks, as `generate --quantization`")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(ns: argparse.Namespace) -> int:
    from tqdm.auto import tqdm

    from engine.args import resolve_dtype
    from engine.kernels.prepare import prepare
    from engine.model_source import resolve_model
    from engine.weights import ModelCheckpoint

    if ns.model is None:
        raise ValueError("convert needs a model: layerstream convert MODEL")
    path = resolve_model(ns.model)
    prepare()  # the entry is laid out for the kernels this CPU uses: choose (build) them first
    checkpoint = ModelCheckpoint(path)
    try:
        dtype = resolve_dtype(ns.dtype, checkpoint.cfg.checkpoint_dtype)
        t0 = time.perf_counter()
        with tqdm(total=checkpoint.cfg.num_layers, desc="converting blocks", unit="block",
                  disable=ns.no_progress, leave=False) as bar:
            entry = checkpoint.convert(dtype, ns.quantization, on_progress=lambda _b: bar.update(1))
    finally:
        checkpoint.close()
    state = f"built in {time.perf_counter() - t0:.1f} s" if entry.built else "already there (checked)"
    print(f"{path}: {entry.what}, {str(dtype).replace('torch.', '')}: {state}\n  {entry.folder}")
    return 0
