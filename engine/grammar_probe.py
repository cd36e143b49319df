"""The grammar probe: a process of its own that compiles a constraint, with its first mask, before
the server does, under a CPU-time budget and a memory limit. A compile cannot be interrupted inside
llguidance, so a budget checked in the server acts only after the cost is paid; a process can be
killed. The probe's verdict decides whether the server compiles the constraint at all.

What callers use (structured_output's GrammarCompiler, from its compile pool):
- `GrammarProbe(tokenizer_json, n_vocab, eos_token_ids, parser_limits, cpu_seconds, max_bytes)`,
  started on first use;
- `probe(grammar) -> ProbeVerdict`: the CPU seconds the compile took, the grammar's error, or why it
  was stopped ("cpu": killed at the budget; "memory": it needed more than max_bytes of address
  space); None when the probe cannot run here (then the server compiles unprobed, and its own
  after-the-fact budget applies);
- `rss_bytes()`: the child's resident memory now (0 when none runs), for /metrics;
- `close()`.
- `serialized_tokenizer(hf_tokenizer) -> str | None`: the fast tokenizer's JSON the child builds its
  own from (None for a slow tokenizer: no probe);
- `probe_memory_bytes(max_bytes, vocab_size)`: what the plan counts for the probe: its start (which
  grows with the vocabulary) and its cap.

The child imports only the standard library and llguidance (no torch: it starts in a fraction of
a second and holds tens of MB, most of them the tokenizer's trie). It runs at the priority of the
thread that starts it (the compile pool's, below the engine's). One probe at a time; a killed child
is replaced by the next probe. This file is also the child's program (run as a script, so it
imports nothing from the package).
"""

from __future__ import annotations

import copy
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

# How often the parent reads the child's CPU time while a compile runs (the kernel counts it in
# ticks of 1/CLK_TCK, 10 ms on Linux; a compile over budget runs at most this much past it).
_POLL_SECONDS = 0.01
# The child's start (reading the tokenizer, building llguidance's trie): generous, a busy machine
# must not disable the probe. Not a request's cost.
_START_SECONDS = 120.0
# The child's peak resident memory while it starts: the interpreter and llguidance, and the
# tokenizer, which llguidance parses from its JSON into a tokenizer and a token trie of its own, about
# 2 KiB per vocabulary entry at its peak (SmolLM2's 49,152 tokens and Gemma 3's 262,144 both stay within
# this estimate: tests/engine/test_grammar_limits.py). Estimated from the vocabulary's size, which the plan
# knows for free: serializing the tokenizer to measure its JSON costs a load a large part of a second.
# A compile may add at most max_bytes of address space.
START_BASE_BYTES = 32 << 20
START_BYTES_PER_TOKEN = 2 << 10
# The child runs this file with neither the working directory nor this file's folder on its path:
# a module there named like one of the standard library's would be imported in its place.
_CHILD = "import runpy, sys; sys.path.pop(0); runpy.run_path(sys.argv[1], run_name='__main__')"


@dataclass(frozen=True)
class ProbeVerdict:
    """cpu_seconds: the compile's CPU time (with its first mask), when it finished; error: the
    grammar's error (first line), when it is invalid or went past a llguidance limit; stopped:
    "cpu" or "memory" when the child was stopped for it."""

    cpu_seconds: float = 0.0
    error: str | None = None
    stopped: str | None = None


class GrammarProbe:
    def __init__(self, tokenizer_json: str, n_vocab: int, eos_token_ids: list[int], parser_limits: dict,
                 cpu_seconds: float, max_bytes: int):
        # json.dumps writes ASCII only (non-ASCII characters escaped): the pipes' encoding never matters.
        self._config = json.dumps({"tokenizer": tokenizer_json, "n_vocab": n_vocab, "eos": eos_token_ids,
                                   "limits": parser_limits, "max_bytes": max_bytes})
        self.cpu_seconds = cpu_seconds
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._child: subprocess.Popen | None = None
        self._broken = sys.platform != "linux"  # CPU time read from /proc; elsewhere no probe
        self.started = 0  # children started (a killed one is replaced)

    def probe(self, grammar: str) -> ProbeVerdict | None:
        with self._lock:
            child = self._ensure()
            if child is None:
                return None
            try:
                child.stdin.write(json.dumps({"grammar": grammar}) + "\n")
                child.stdin.flush()
            except OSError:
                self._stop()
                return None
            cpu0 = _cpu_seconds(child.pid)
            while True:
                ready, _, _ = select.select([child.stdout], [], [], _POLL_SECONDS)
                if ready:
                    line = child.stdout.readline()
                    if line:
                        reply = json.loads(line)
                        return ProbeVerdict(cpu_seconds=reply["cpu"], error=reply["error"])
                    # The child died: an allocation over its address-space limit aborts it.
                    self._stop()
                    return ProbeVerdict(cpu_seconds=0.0, stopped="memory")
                used = _cpu_seconds(child.pid) - cpu0
                if used > self.cpu_seconds:
                    self._stop()
                    return ProbeVerdict(cpu_seconds=used, stopped="cpu")

    def rss_bytes(self) -> int:
        child = self._child
        if child is None:
            return 0
        try:
            with open(f"/proc/{child.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):  # gone between the check and the read
            return 0

    def _ensure(self) -> subprocess.Popen | None:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._child = None
        if self._broken:
            return None
        try:
            child = subprocess.Popen([sys.executable, "-s", "-c", _CHILD, os.path.abspath(__file__)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, bufsize=1 << 16)
            child.stdin.write(self._config + "\n")
            child.stdin.flush()
            ready, _, _ = select.select([child.stdout], [], [], _START_SECONDS)
            if not ready or child.stdout.readline().strip() != "ready":
                raise OSError("the grammar probe did not start")
        except (OSError, ValueError):
            # No probe (cannot start a process here): compiles go on unprobed, as before it.
            self._broken = True
            if "child" in locals():
                child.kill()
                child.wait()
            return None
        self._child = child
        self.started += 1
        return child

    def _stop(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            child.kill()
            child.wait()
            for f in (child.stdin, child.stdout):
                try:
                    f.close()
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            self._stop()


def serialized_tokenizer(hf_tokenizer) -> str | None:
    """The fast tokenizer as JSON without padding or truncation (what llguidance.hf.from_tokenizer
    reads too); None for a slow tokenizer, which has none."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


def probe_memory_bytes(max_bytes: int, vocab_size: int) -> int:
    """Host memory the probe may hold: its start, which grows with the vocabulary, and the growth its
    address-space limit allows."""
    return START_BASE_BYTES + START_BYTES_PER_TOKEN * vocab_size + max_bytes


def _cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:  # gone: its last reading stands
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _serve() -> None:
    """The child: read the config, build the tokenizer, then compile each grammar it is sent."""
    import ctypes
    import resource

    from llguidance import LLMatcher, LLParserLimits, LLTokenizer

    config = json.loads(sys.stdin.readline())
    tok = LLTokenizer(config.pop("tokenizer"), n_vocab=config["n_vocab"], eos_token=config["eos"] or None)
    limits = LLParserLimits(**config["limits"])
    words = (config["n_vocab"] + 31) // 32
    mask = (ctypes.c_uint32 * words)()  # (vocab / 32,) one bit per token
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)  # the tokenizer's JSON (megabytes, read twice) is garbage now: only the trie stays
    # From here on, the process may grow by max_bytes: a compile that needs more aborts it (Rust's
    # allocation failure), which the parent reads as "memory".
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + config["max_bytes"], resource.RLIM_INFINITY))
    print("ready", flush=True)
    for line in sys.stdin:
        grammar = json.loads(line)["grammar"]
        cpu0 = time.process_time()
        matcher = LLMatcher(tok, grammar, log_level=0, limits=limits)
        if not matcher.is_error():
            matcher.unsafe_compute_mask_ptr(ctypes.addressof(mask), words * 4)
        error = (matcher.get_error().splitlines() or ["invalid"])[0] if matcher.is_error() else None
        cpu = time.process_time() - cpu0
        del matcher
        if trim is not None:
            trim(0)  # what the compile freed goes back to the system: the child stays small between probes
        print(json.dumps({"cpu": cpu, "error": error}), flush=True)


if __name__ == "__main__":
    _serve()
