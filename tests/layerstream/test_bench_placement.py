"""bench-placement end to end on the simulated link (the tiny shape, --device cpu): the budget is raised to where
every policy places groups, each policy's rows come back, and the path counters agree with the policy: under cpu
no weight crosses the link, under stream no group computes on the CPU, and streamed bytes are whole MLPs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from layerstream.bench import placement

ROOT = Path(__file__).resolve().parents[2]
BATCH = 4


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("placement")
    out = subprocess.run([sys.executable, "-m", "layerstream", "bench-placement", "--device", "cpu", "--shape", "tiny",
                          "--prompt-tokens", "64", "--batch", str(BATCH), "--batch-prompt-tokens", "8",
                          "--decode-tokens", "4", "--threads", "1", "--json", str(tmp / "r.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "LAYERSTREAM_BENCH_DIR": str(tmp), "LAYERSTREAM_SIM_GBPS": "50"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout, json.loads((tmp / "r.json").read_text())


def test_the_table_has_every_policy_s_rows_and_the_verdicts(tiny_run):
    stdout, r = tiny_run
    assert "SIMULATED" in stdout and "llama.cpp: not available (no GPU" in stdout
    # 25% of the tiny model holds not even its embeddings: raised, and said so
    assert "raised to" in stdout and r["budget_fraction"] > 0.25
    cells = {}
    for line in stdout.splitlines():
        parts = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and parts[0] in placement.POLICIES:
            cells[(parts[0], parts[1])] = parts
    assert set(cells) == {(p, row) for p in placement.POLICIES for row in ("prefill", "batch 1", f"batch {BATCH}")}
    assert all(float(c[2]) > 0 and float(c[5]) > 0 for c in cells.values()), cells  # tok/s and floor tok/s
    verdicts = [line for line in stdout.splitlines() if line.startswith("SIMULATED verdict: ")]
    assert len(verdicts) == 4 and verdicts[-1].endswith("not measured (no GPU (--device cpu))"), verdicts


def test_the_path_counters_agree_with_each_policy(tiny_run):
    _, r = tiny_run
    results = r["results"]
    off = {p: results[p]["off_device"] for p in placement.POLICIES}
    assert all(n > 0 for n in off.values()), off
    for policy, res in results.items():
        for name, ph in res["phases"].items():
            assert ph["steps"] > 0 and ph["tokens"] > 0 and ph["seconds"] > 0, (policy, name, ph)
            # every off-device MLP computes once per step, on one path or the other
            assert ph["groups_cpu"] + ph["groups_stream"] == off[policy] * ph["steps"], (policy, name, ph)
            # streamed: whole MLPs cross, and nothing else streams (attention and norms stay on the device)
            assert ph["bytes_stream"] == ph["groups_stream"] * res["mlp_bytes"] == ph["bytes_streamed"], (policy, ph)
            assert ph["cpu_read_bytes"] == ph["groups_cpu"] * res["mlp_bytes"]
            if policy == "cpu":
                assert ph["groups_stream"] == ph["steps_stream"] == ph["bytes_streamed"] == 0, (name, ph)
                assert ph["steps_cpu"] == ph["steps"] and ph["bytes_cpu"] > 0
            if policy == "stream":
                assert ph["groups_cpu"] == ph["steps_cpu"] == ph["bytes_cpu"] == ph["cpu_read_bytes"] == 0, (name, ph)
                assert ph["steps_stream"] == ph["steps"]
        assert res["phases"]["batch N"]["tokens"] == BATCH * res["phases"]["batch 1"]["tokens"]
    rows = r["rows"]
    assert rows["cpu"][1]["link_per_token"] == 0 and rows["stream"][1]["cpu_per_token"] == 0


def test_a_policy_name_is_checked():
    ns = placement.argparse.Namespace(policies="stream,gpu", device="cpu", child=None)
    with pytest.raises(ValueError, match="unknown policy 'gpu'"):
        placement.run(ns)


def test_verdicts_compare_auto_with_the_better_policy_and_with_llama_cpp():
    def rows(*tps):
        return [{"tps": t} for t in tps]

    lines = placement.verdicts({"stream": rows(100.0, 2.0, 30.0), "cpu": rows(50.0, 5.0, 20.0),
                                "auto": rows(100.0, 4.9, 31.0)}, 16, llama_b1=4.0, why_not=None)
    assert lines[0].startswith("auto >= best of stream, cpu at prefill: MET (100.00 vs 100.00")
    assert lines[1].startswith("auto >= best of stream, cpu at batch 1: NOT MET (4.90 vs 5.00")
    assert lines[2].startswith("auto >= best of stream, cpu at batch 16: MET (31.00 vs 30.00")
    assert lines[3].startswith("auto >= 1.2x llama.cpp at batch 1: MET (4.90 vs 4.00 tok/s, 1.23x)")
    lines = placement.verdicts({"stream": rows(1.0, 1.0, 1.0), "auto": rows(1.0, 1.0, 1.0)}, 16, None, "why")
    assert lines == ["auto >= best of stream, cpu: not measured (a policy left out or failed)",
                     "auto >= 1.2x llama.cpp at batch 1: not measured (why)"]
