"""`layerstream convert MODEL` (layerstream/convert.py): a GGUF file's prepacked cache entry, or a
safetensors checkpoint's --quantization entry, built ahead of time, found the second time; clear
errors where there is nothing to convert."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as Q

from engine import kernels
from engine.kernels import ggml_repack as repack_module
from layerstream.cli import main as layerstream_main
from tests.support.gguf_models import tiny_gguf

DATA = "blocks.bin"


@pytest.fixture(scope="module")
def gguf_root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-convert")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_convert_command(gguf_root, cache, model_dirs, capsys):
    """`layerstream convert`: a GGUF file's entry built, then found; --quantization on safetensors builds
    that cache's entry; a safetensors folder without it, or a GGUF with it, is a clear error (exit 2)."""
    if kernels.int4_backend() != "vnni" or repack_module.ggml_repack() is None:
        pytest.skip("the VNNI kernels or the repack do not run here: GGUF blocks are not prepacked")
    path = tiny_gguf(gguf_root, "llama", Q.Q4_0)
    assert layerstream_main(["convert", str(path), "--no-progress"]) == 0
    assert "prepacked" in capsys.readouterr().out and list(cache.glob(f"prepacked-v*/*/{DATA}"))
    assert layerstream_main(["convert", str(path), "--no-progress"]) == 0
    assert "already there" in capsys.readouterr().out
    folder = model_dirs["llama"]
    assert layerstream_main(["convert", str(folder), "--quantization", "int8", "--dtype", "bfloat16",
                             "--no-progress"]) == 0
    assert "quantized to int8" in capsys.readouterr().out and list(cache.glob("quantized-v*/*/model.safetensors"))
    assert layerstream_main(["convert", str(folder), "--no-progress"]) == 2
    assert "nothing to convert" in capsys.readouterr().err
    assert layerstream_main(["convert", str(path), "--quantization", "int4", "--no-progress"]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert layerstream_main(["convert", str(path), "--dtype", "float32", "--no-progress"]) == 2
    assert "no prepacked form in float32" in capsys.readouterr().err
