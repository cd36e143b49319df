"""ModelConfigs are made once per config (engine/config_cache.py): a later load reads the cached one without
importing transformers' config classes; an edited config.json is another entry; a damaged entry is made again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from engine.arch import load_model_config
from engine.cache import cache_root
from tests.support.models import build


def _entries() -> set[Path]:
    return set((cache_root() / "model-config-v1").glob("*.pickle"))


def test_a_config_is_made_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    model = build(tmp_path / "llama", "llama")
    first = load_model_config(model)
    assert len(_entries()) == 1
    assert load_model_config(model) == first
    code = ("import sys; from engine.arch import load_model_config; "
            f"load_model_config({str(model)!r}); "
            "print([m for m in sys.modules if m.startswith('transformers.models.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip().splitlines()[-1] == "[]"  # read back: transformers' config classes not imported

    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-3
    (model / "config.json").write_text(json.dumps(cfg))
    edited = load_model_config(model)
    assert edited.rms_norm_eps == 1e-3 and first.rms_norm_eps != 1e-3 and len(_entries()) == 2


def test_a_damaged_entry_is_made_again(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSTREAM_CACHE", str(tmp_path / "cache"))
    model = build(tmp_path / "llama", "llama")
    made = load_model_config(model)
    (entry,) = _entries()
    for damage in (b"", b"\x80\x04garbage", b"\x80\x04K\x05."):  # empty, truncated, a pickled int
        entry.write_bytes(damage)
        assert load_model_config(model) == made
        assert entry.read_bytes() != damage  # rewritten whole
