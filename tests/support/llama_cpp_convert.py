"""llama.cpp's own converter (convert_hf_to_gguf.py, vendored in the llama-cpp-python 0.3.36 sdist) run on a
tiny checkpoint, for the GGUF tests of families whose files only that converter defines (tensor names,
metadata, what it changes in tensors).

The sdist is looked for unpacked at $LAYERSTREAM_LLAMA_CPP_SDIST, else beside the benchmarks
($LAYERSTREAM_BENCH_DIR, default /var/tmp/layerstream-bench, where `layerstream bench-scale` unpacks it);
`llama_cpp_root()` is None when it is not there, and the tests skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SDIST = "llama_cpp_python-0.3.36"

# The converter names a BPE pre-tokenizer by a fingerprint of its outputs; a tiny test tokenizer matches none,
# so the run names it GPT-2's (what it is built like). Llama-like families try a sentencepiece vocabulary first, and
# the converter imports sentencepiece (not a dependency here) before it looks for tokenizer.model; a tiny checkpoint
# has none, so the try fails on the missing file first, as it would with sentencepiece installed, and the converter
# falls back to the BPE vocabulary. Everything else is the converter's own code.
_WRAPPER = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sentencepiece_vocab = base.TextModel._create_vocab_sentencepiece
def without_model_file(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return sentencepiece_vocab(self)
base.TextModel._create_vocab_sentencepiece = without_model_file
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def llama_cpp_root() -> Path | None:
    """The vendored llama.cpp folder holding convert_hf_to_gguf.py, or None."""
    bench = Path(os.environ.get("LAYERSTREAM_BENCH_DIR", "/var/tmp/layerstream-bench"))
    given = os.environ.get("LAYERSTREAM_LLAMA_CPP_SDIST")
    for sdist in ([Path(given)] if given else []) + [bench / SDIST, *sorted(bench.glob(f"scale-*/{SDIST}"))]:
        root = sdist / "vendor" / "llama.cpp"
        if (root / "convert_hf_to_gguf.py").exists():
            return root
    return None


def convert(hf_folder: Path, out: Path, outtype: str = "f32") -> Path:
    """hf_folder converted by llama.cpp's converter into out (outtype: f32, f16, bf16 or q8_0)."""
    root = llama_cpp_root()
    assert root is not None, "llama.cpp's converter is not available (see this module's docstring)"
    cfg = json.loads((hf_folder / "tokenizer_config.json").read_text())
    if cfg.get("tokenizer_class") != "GPT2Tokenizer":  # Phi-3's converter takes a BPE vocabulary only so
        cfg["tokenizer_class"] = "GPT2Tokenizer"
        (hf_folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-c", _WRAPPER, str(root), str(hf_folder), "--outtype", outtype,
                        "--outfile", str(out)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ""})
    if r.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_folder}:\n{r.stderr[-3000:]}")
    return out
