"""layerstream.bench.amx's two A/Bs run and put back what they switch (the process-wide choices they flip)."""

from __future__ import annotations

import argparse
import re

from layerstream.bench import amx
from engine import ops


def test_attention_ab_reports_both_paths_and_restores_the_choice():
    before = ops.bf16_matmul_attention
    lines = amx.attention_ab(argparse.Namespace(calls=2))
    assert ops.bf16_matmul_attention is before
    assert [line.split(":")[0] for line in lines] == ["128 tokens over 2000 keys", "128 tokens over 1000 keys"]
    for line in lines:
        errors = [float(e) for e in re.findall(r"error max ([0-9.e+-]+)", line)]
        assert "flash min" in line and "matmul path min" in line and len(errors) == 2
        assert all(0 < e < 5e-3 for e in errors), line  # bf16 attention against float64: noise, not a bug


def test_step_ab_times_both_choices_and_restores_them(llama_dir):
    choice, linear = ops.onednn_has_amx, ops.linear
    line = amx.step_ab(llama_dir, None, argparse.Namespace(rounds=2, steps=3), products=True,
                      max_model_len=256)
    assert ops.onednn_has_amx is choice and ops.linear is linear
    assert re.search(r"oneDNN( [0-9.]+){2} \(median [0-9.]+\) \| torch's kernel( [0-9.]+){2}", line), line
    shares = [int(s) for s in re.findall(r"(\d+)% ", line)]
    assert len(shares) == 2 and all(0 < s <= 100 for s in shares), line
