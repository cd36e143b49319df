"""scripts/gpu_check.sh must run as is on a GPU machine that no test here can reach, so CI runs its
dry run: the same Python choice, package check, cuda test collection and benchmark import, with the
packages a GPU image lacks (the server's) made unimportable."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
CUDA_TESTS = ROOT / "tests" / "weights" / "test_cuda.py"  # what the script runs, with -m cuda
# What the device image holds is listed in the device notes; these it does not have. gguf the engine
# imports: the script installs it from the wheel committed in .whl/ (a GPU run failed at import for want of it).
ABSENT_ON_GPU_IMAGE = ("fastapi", "uvicorn", "starlette", "pydantic", "pydantic_core", "openai", "gguf")


def run_script(*args: str, env_extra: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(env_extra)
    # The dry run took 67 s on a lightly loaded 2-core machine and over 240 s at a load average of 25.
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)


def without(tmp_path: Path, packages: tuple[str, ...]) -> dict[str, str]:
    """Environment for a Python that cannot import `packages` (a sitecustomize that refuses them) but
    from the folder the script installs carried wheels into, as on the GPU image."""
    block, site = tmp_path / "block", tmp_path / "site"
    block.mkdir()
    (block / "sitecustomize.py").write_text(
        "import sys\n"
        "class Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] not in {packages!r}:\n"
        "            return None\n"
        "        for finder in sys.meta_path:\n"
        "            spec = None if finder is self else finder.find_spec(name, path, target)\n"
        "            if spec is not None:\n"
        f"                if (spec.origin or '').startswith({str(site)!r}):\n"
        "                    return spec\n"
        "                break\n"
        "        raise ImportError('not installed here: ' + name)\n"
        "sys.meta_path.insert(0, Absent())\n")
    return {"PYTHON": sys.executable, "PYTHONPATH": str(block), "GPU_CHECK_SITE": str(site)}


@pytest.mark.timeout(900)
def test_dry_run_without_server_packages(tmp_path):
    r = run_script("--dry-run", env_extra=without(tmp_path, ABSENT_ON_GPU_IMAGE), tmp_path=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    # The probe ran first and printed each of its lines (the CPU's answers here).
    stages = [out.index(f"== {s}") for s in ("probe", "cuda tests: copy stream", "cuda tests: against transformers",
                                             "benchmark")]
    assert stages == sorted(stages), out
    probe = out[stages[0]:stages[1]]
    for line in ("torch ", "transformers ", "MemAvailable", "sdpa ours (attention_backend.attend): ",
                 "first call", "new context length", "cudaHostRegister: n/a", "host->device: n/a"):
        assert line in probe, probe
    # Every cuda test collected (none failed to import), the copy-stream ones in their own call
    # before the reference comparisons, and each skipped here for want of a GPU.
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", str(CUDA_TESTS),
                                "-p", "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True).stdout
    ids = [line for line in collected.splitlines() if "::" in line]
    n_ref = sum("test_matches_transformers_on_gpu" in i for i in ids)
    n_copy = len(ids) - n_ref
    if not torch.cuda.is_available():
        copy_part = out[stages[1]:stages[2]]
        ref_part = out[stages[2]:stages[3]]
        assert f"{n_copy} skipped" in copy_part and "test_no_buffer_reuse_hazard_under_stress" in copy_part, copy_part
        assert f"{n_ref} skipped" in ref_part and "test_matches_transformers_on_gpu" in ref_part, ref_part
    assert "layerstream.bench.gpu loads" in out and "tests rc=0, benchmark rc=0" in out, out
    assert "lacks: gguf; installing" in out and any((tmp_path / "site").glob("gguf-*.dist-info")), out


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_placement.sh"])
def test_check_runs_offline(script):
    """The GPU machine has no network: the set-up the GPU scripts share exports the hub's offline switches before
    any Python runs, and each script sources it before running its own."""
    setup = (ROOT / "scripts" / "gpu_env.sh").read_text()
    assert setup.index("export HF_HUB_OFFLINE=1") < min(setup.index("fit()"), setup.index('"$PY"'))
    text = (ROOT / "scripts" / script).read_text()
    assert text.index(". scripts/gpu_env.sh") < text.index('"$PY"')


def test_dry_run_names_missing_packages(tmp_path):
    r = run_script("--dry-run", env_extra=without(tmp_path, ("accelerate",)), tmp_path=tmp_path)
    assert r.returncode == 1 and "lacks: accelerate" in r.stderr, r.stdout + r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without a GPU")
def test_refuses_without_a_gpu(tmp_path):
    r = run_script(env_extra={"PYTHON": sys.executable}, tmp_path=tmp_path)
    assert r.returncode == 1 and "no NVIDIA GPU visible" in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("fraction", [None, 0.5], ids=["resident", "streaming"])
def test_benchmark_peer_runs_on_cpu(llama_dir, fraction):
    """layerstream.bench.gpu's budget and its measurement of a layerstream peer, on the CPU device: the figures
    it reads from the engine (plan, streamer stats, per-step stalls) exist and are sane, so the GPU
    run only adds the device."""
    import argparse

    from layerstream.bench.gpu import _layerstream, device_budget

    ns = argparse.Namespace(device="cpu", dtype="float32", prompt_tokens=8, max_tokens=6, resident_fraction=fraction)
    budget, plan, keep = device_budget(ns, llama_dir) if fraction else (None, None, None)
    r = _layerstream(ns, llama_dir, budget, pin=False)
    assert r["tpot_s"] > 0 and r["stall_ms_per_step"] >= 0 and r["load_s"] > 0
    if fraction is None:
        assert r["streamed_blocks"] == 0 and r["bytes_per_token"] == 0
    else:
        assert r["resident_blocks"] == keep == plan.num_layers // 2 and r["streamed_blocks"] == plan.num_layers - keep
        assert r["bytes_per_token"] == r["streamed_blocks"] * plan.block_bytes


def test_benchmark_chart_is_written(tmp_path):
    """The plot the GPU run leaves beside its JSON, from results shaped as run() makes them (a peer
    without figures is drawn empty, not an error)."""
    from layerstream.bench.gpu import chart

    results = {"resident": {"tpot_s": 0.004, "floor_s": None, "achieved_gbps": None},
               "streaming": {"tpot_s": 0.012, "floor_s": 0.010, "achieved_gbps": 41.5},
               "transformers+accelerate offload": {"tpot_s": 0.060, "floor_s": 0.010, "achieved_gbps": 6.9}}
    out = tmp_path / "gpu.png"
    chart(results, "NVIDIA H200", "llama").save(str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.parametrize("host_memory,pinned", [("8GiB", True), ("2GiB", False)], ids=["fits", "falls-back"])
def test_benchmark_pinned_row_states_its_host_budget(llama_dir, monkeypatch, capsys, host_memory, pinned):
    """The pinned row passes an explicit host budget, and says so when the pinned cache did not fit
    it and the row ran from staging (CudaTransport replayed on CPU; 2 GiB leaves nothing above the
    transport's 2 GiB margin)."""
    import argparse

    import engine.weights.transports.cuda as ct
    from layerstream.bench.gpu import _layerstream, device_budget, pinned_host_budget
    from engine.planner import parse_bytes
    from tests.support.cuda_replay import RecordingRuntime

    monkeypatch.setattr(ct, "CudaRuntime", RecordingRuntime)
    ns = argparse.Namespace(device="cpu", dtype="float32", prompt_tokens=8, max_tokens=4, resident_fraction=0.5,
                            max_host_memory=host_memory)
    budget, plan, _keep = device_budget(ns, llama_dir)
    host = pinned_host_budget(ns, plan)
    assert host == parse_bytes(host_memory)
    r = _layerstream(ns, llama_dir, budget, pin=True, host_memory=host, transport="cuda")
    assert r["pinned_cache"] == pinned and r["fell_back_to_staging"] == (not pinned)
    assert r["host_memory_budget"] == host and r["streamed_blocks"] > 0
    assert ("FELL BACK to staging" in capsys.readouterr().out) == (not pinned)
    ns.max_host_memory = None  # the default: what the pinned cache needs, plus margins, stated
    assert pinned_host_budget(ns, plan) == len(plan.streamed_blocks) * plan.block_bytes + ct.HOST_MARGIN + (1 << 30)
