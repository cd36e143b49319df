"""Shared pieces of the benchmarks: the benchmark checkpoint, process memory sampling, percentiles,
tables and charts. Nothing here imports torch at module level, so the HTTP benchmark's client side
stays light."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

BENCH_ROOT = Path(os.environ.get("LAYERSTREAM_BENCH_DIR", "/var/tmp/layerstream-bench"))
BENCH_MODEL_VERSION = "1"


def bench_model_config():
    """A Llama of ~241M parameters, ~0.48 GB in bf16. A small vocabulary keeps the embeddings and
    head (which are always resident) at 7% of the weights, so a budget of 25% of the weights can
    still hold them plus the stream buffers and leaves the blocks to stream."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
    )


def cached_random_model(name: str, config, root: Path = BENCH_ROOT, **build_kw) -> Path:
    """Build a random-weight bf16 checkpoint once, outside the repository, and reuse it after."""
    folder = root / f"{name}-v{BENCH_MODEL_VERSION}"
    import torch

    from engine.cache import build_once
    from engine.demo import build_random_model

    def build(tmp: Path) -> None:
        print(f"building the benchmark checkpoint {name} in {folder} (once)", file=sys.stderr)
        build_random_model(tmp, config, dtype=torch.bfloat16, seed=7, **build_kw)

    return build_once(folder, "layerstream-bench.json", {"version": BENCH_MODEL_VERSION, "random_weights": True},
                      build)


def bench_model_path(root: Path = BENCH_ROOT) -> Path:
    return cached_random_model("llama-241m-bf16", bench_model_config(), root, tokenizer_vocab=512)


def _weight_files(path: Path) -> list[Path]:
    """A folder's safetensors files, or the one file named (a GGUF file)."""
    path = Path(path)
    return [path] if path.is_file() else sorted(path.glob("*.safetensors"))


def checkpoint_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in _weight_files(folder))


def warm_page_cache(folder: Path) -> float:
    """Read every weight file once so each peer starts with the checkpoint in the page cache."""
    t0 = time.perf_counter()
    for p in _weight_files(folder):
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - t0


def bench_main(prog: str, doc: str | None, add_arguments, run, argv: list[str] | None) -> int:
    """`python -m bench.X`: the same arguments as the `layerstream` subcommand, then its run()."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


# -- memory of a child process ------------------------------------------------------------------

def read_status(pid: int) -> dict[str, int]:
    """VmRSS / RssAnon / RssFile / VmHWM of a process in bytes ({} once it has exited)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


@dataclass
class MemoryPeaks:
    rss: int = 0
    rss_anon: int = 0
    samples: int = 0


class MemorySampler:
    """Polls a process's /proc status every `interval` seconds; the kernel keeps a peak of RSS
    (VmHWM) but none of anonymous memory alone, so the anonymous peak is sampled."""

    def __init__(self, pid: int, interval: float = 0.005):
        self.pid, self.interval = pid, interval
        self.peaks = MemoryPeaks()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            st = read_status(self.pid)
            if st:
                self.peaks.rss = max(self.peaks.rss, st.get("VmHWM", 0), st.get("VmRSS", 0))
                self.peaks.rss_anon = max(self.peaks.rss_anon, st.get("RssAnon", 0))
                self.peaks.samples += 1
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Child:
    """A peer in its own process, driven line by line: it prints one JSON line when loaded and one
    per command it is sent ("trial", "done"), and exits on "exit". The parent samples its memory
    the whole time, and reads its VmHWM before telling it to exit."""

    def __init__(self, argv: list[str], timeout: float, env: dict | None = None):
        self.argv, self.timeout = argv, timeout
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.sampler = MemorySampler(self.proc.pid).__enter__()

    def read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("{"):
                return json.loads(line)
        self.kill()
        raise RuntimeError(f"{' '.join(self.argv)} exited with {self.proc.returncode} and no result")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def finish(self) -> MemoryPeaks:
        """Stop sampling, fold in the kernel's VmHWM, and let the child exit."""
        final = read_status(self.proc.pid)
        self.sampler.__exit__()
        peaks = self.sampler.peaks
        peaks.rss = max(peaks.rss, final.get("VmHWM", 0))
        peaks.rss_anon = max(peaks.rss_anon, final.get("RssAnon", 0))
        try:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        return peaks

    def kill(self) -> None:
        self.sampler._stop.set()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def serve_commands(handlers: dict, first: dict) -> None:
    """The child side of Child: print `first`, then answer each command line with handler()'s dict."""
    def emit(d: dict) -> None:
        sys.stdout.write(json.dumps(d) + "\n")
        sys.stdout.flush()

    emit(first)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "exit" or not cmd:
            return
        emit(handlers[cmd]())


# -- reporting ----------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    """Poll a launched `layerstream serve` until /health answers 200; raise with its log's tail if
    it exits or does not get there in time."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not become healthy in {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def idle_until_collapsed(engine, limit: float) -> float:
    """Idle, as a server between requests, until the engine's resident copies are in huge pages (it collapses them
    only while no step runs), the collapse stops making progress for 10 s, or `limit` seconds pass; returns the
    seconds idled."""
    t_idle, progress, done = time.perf_counter(), time.perf_counter(), -1
    while time.perf_counter() - t_idle < limit:
        t = engine.telemetry()
        if t.resident_copies_in_huge_pages >= t.resident_copies:
            break
        if t.resident_copies_in_huge_pages != done:
            done, progress = t.resident_copies_in_huge_pages, time.perf_counter()
        elif time.perf_counter() - progress > 10.0:
            break
        time.sleep(0.25)
    return time.perf_counter() - t_idle


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def mib(n: int | float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table (also readable in a terminal)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = f", {int(line.split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPUs{mem}"


@dataclass
class Chart:
    """Grouped bar charts, one panel per metric; written only when --png is given."""

    title: str
    panels: list[tuple[str, list[str], list[float | None], list[int] | None]] = field(default_factory=list)

    def add(self, metric: str, labels: list[str], values: list[float | None], groups: list[int] | None = None) -> None:
        """groups: a colour index per bar (default: one colour per bar)."""
        self.panels.append((metric, labels, values, groups))

    def save(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(self.panels), figsize=(4.2 * len(self.panels), 3.8), squeeze=False)
        colors = ["#7f7f7f", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd"]
        for ax, (metric, labels, values, groups) in zip(axes[0], self.panels):
            vals = [v or 0.0 for v in values]
            groups = groups or list(range(len(vals)))
            bars = ax.bar(range(len(vals)), vals, color=[colors[g % len(colors)] for g in groups])
            ax.set_xticks(range(len(vals)), labels, rotation=20, ha="right", fontsize=8)
            ax.set_title(metric, fontsize=10)
            for b, v in zip(bars, values):
                if v is not None:
                    ax.annotate(f"{v:.0f}" if v >= 100 else f"{v:.3g}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                                va="bottom", fontsize=7)
        fig.suptitle(self.title, fontsize=11)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
