"""Compiling the C++ kernels into the layerstream cache, once per source, flags and torch.

A kernel's build folder is `cache_root()/kernels/<name>-<key>`, the key hashing its source, the
compiler flags and torch's version, so a changed source or torch gets a fresh build and an
unchanged one is only imported (no compiler, no ninja) by every later process. Builds happen ahead
of any request: `layerstream build-kernels` (setup, the image build) or the engine's start-up
(engine.kernels.prepare); each takes torch's headers through a compiler, so allow minutes on 2 cores.

A build runs in a folder of its own process and is renamed into place when complete, so a build
killed half-way (Ctrl-C, OOM) leaves no folder that a later process trusts or waits on.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from ..cache import cache_root

log = logging.getLogger("layerstream")

STALE_DAYS = 7
# Explicit instruction sets rather than -march=native: the built library then runs on any CPU
# that has them (a cache folder shared between machines), and the loader checks the CPU at run time.
CFLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma")
# Every kernel is built with OpenMP, whatever its own flags: at::parallel_for is a header template whose
# OpenMP body compiles only under _OPENMP; without the flag it silently runs the whole range on the
# calling thread (each kernel used one core of two until this was found). The symbols resolve to the
# libgomp torch itself loads, so there is one thread pool, sized by torch.set_num_threads.
PARALLEL = ("-fopenmp",)


_stopped = threading.Event()  # stop_builds() was called: the process is going away


def _with_parallel(cflags: tuple[str, ...]) -> tuple[str, ...]:
    return (*cflags, *(f for f in PARALLEL if f not in cflags))


def build_folder(name: str, source: Path, cflags: tuple[str, ...] = CFLAGS, includes: tuple[Path, ...] = ()) -> Path:
    key = hashlib.sha256(b"\0".join([source.read_bytes(), *(p.read_bytes() for p in includes),
                                     " ".join(_with_parallel(cflags)).encode(), torch.__version__.encode(),
                                     sys.version.encode()])).hexdigest()[:16]
    return cache_root() / "kernels" / f"{name}-{key}"


def _import(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch builds with the `ninja` command; the PyPI package puts it beside the interpreter, which
    is not on PATH when the virtualenv is not activated (`.venv/bin/python -m engine.cli`)."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return  # torch's own check then says ninja is missing
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def compile_extension(name: str, source: Path, cflags: tuple[str, ...] = CFLAGS,
                      includes: tuple[Path, ...] = ()) -> ModuleType:
    """The extension built from one C++ source file, compiled once per (source, the files it
    #includes from this folder, flags, torch). Raises whatever the build raises (no compiler, a
    compile error, no ninja)."""
    folder = build_folder(name, source, cflags, includes)
    library = folder / f"{name}.so"
    if library.exists():
        try:
            os.utime(folder)  # in use: not stale (see _prune)
        except OSError:
            pass  # a read-only cache still loads
        return _import(name, library)
    if _stopped.is_set():
        raise RuntimeError("the process is stopping")
    from torch.utils.cpp_extension import load

    _ninja_on_path()
    # torch's own lock lives in the build folder and is never released by a killed build; a folder
    # per process (renamed into place below) means no later build ever waits on a dead one's lock.
    work = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log.info("compiling the %s kernel once into %s ...", name, folder)
    start = time.monotonic()
    try:
        module = load(name=name, sources=[str(source)], extra_cflags=list(_with_parallel(cflags)),
                      build_directory=str(work), verbose=False)
        if folder.exists() and not library.exists():
            shutil.rmtree(folder, ignore_errors=True)  # an incomplete build left by an older layerstream
        try:
            work.rename(folder)
        except OSError:
            if not library.exists():
                raise
            # another process built the same kernel first: identical, and this one is already loaded
        module.__file__ = str(library)  # where the loaded bytes now lie (the work folder is gone)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # (the loaded library stays mapped)
    log.info("compiled the %s kernel in %.0f s", name, time.monotonic() - start)
    _prune(name, folder)
    return module


def stopping() -> bool:
    """Whether stop_builds() has been called in this process."""
    return _stopped.is_set()


def stop_builds() -> int:
    """Kill the compilers of every build this process is running (torch runs each build as a ninja
    child), so a server stopped while it builds, or a Ctrl-C that reached only this process, leaves
    no compiler running behind it; the builds then fail, which is their logged fallback. Returns how
    many processes it killed. Builds that have not started yet never will."""
    _stopped.set()
    # Freeze before killing: a ninja (or a compiler's shell) left running between a scan and its kill can start
    # the next compile, whose process the scan did not see and which outlives this one. A stopped process forks
    # nothing more, so the tree is scanned again until no new process appears, and only then killed.
    frozen: list[int] = []
    while fresh := [pid for pid in _build_processes() if pid not in frozen]:
        for pid in fresh:
            _signal(pid, signal.SIGSTOP)
        _until_stopped(fresh)
        frozen += fresh
    for pid in reversed(frozen):  # compilers before the ninja that would start the next one
        _signal(pid, signal.SIGKILL)
    return len(frozen)


def _build_processes() -> list[int]:
    """This process's ninja children and all their descendants, each parent before its children."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], [pid for pid in children.get(os.getpid(), ()) if _command(pid) == "ninja"]
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack += children.get(pid, [])
    return found


def _until_stopped(pids: list[int], timeout_s: float = 1.0) -> None:
    """Until each of `pids` is stopped or gone: a SIGSTOP takes effect when the process next leaves the kernel,
    so one in the middle of a fork could otherwise add its child after the scan that follows."""
    deadline = time.monotonic() + timeout_s
    waiting = list(pids)
    while waiting and time.monotonic() < deadline:
        waiting = [pid for pid in waiting if _state(pid) not in ("T", "t", "Z", "X", "")]
        if waiting:
            time.sleep(0.001)


def _state(pid: int) -> str:
    """The process's state letter (R, S, D, T, Z, ...), "" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass  # gone meanwhile


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def compile_or_reason(name: str, source: Path, cflags: tuple[str, ...] = CFLAGS,
                      includes: tuple[Path, ...] = ()) -> tuple[ModuleType | None, str]:
    """(the extension, "") or (None, why it could not be built: one line for the fallback's warning).
    Any build failure (no compiler, no ninja, a compile error) means a fallback, said loudly."""
    try:
        return compile_extension(name, source, cflags, includes), ""
    except Exception as e:  # noqa: BLE001 - every failure is reported, none is fatal
        last = str(e).strip().splitlines()[-1][:300] if str(e).strip() else ""
        return None, f"could not be built ({type(e).__name__}: {last})"


def optional_kernel(setting: str, off: str, what: str, name: str, source: Path, cflags: tuple[str, ...] = CFLAGS,
                    includes: tuple[Path, ...] = (), *, blocked: Callable[[], str | None] | None = None,
                    cpu_check: str | None = None, subject: str = "it",
                    blocked_level: int = logging.WARNING) -> ModuleType | None:
    """A kernel with a logged fallback, decided as each engine.kernels loader decides it (once per process:
    the loaders cache it). The environment variable `setting` is auto (the default) or `off` (any other
    value: ValueError). None, with f"{what}: {reason}" logged once, when it says `off`, when blocked()
    gives a reason (a kernel this one is made of is not in use), when the source cannot be built ("{subject}
    could not be built (...)"), or, with cpu_check given, when the module's cpu_supported() is false (the
    reason then being cpu_check); else the module. A blocked() reason is logged at blocked_level (INFO
    where it names a better choice, not a fallback)."""
    wanted = os.environ.get(setting, "auto")
    if wanted not in ("auto", off):
        raise ValueError(f"{setting} must be auto or {off}, got {wanted!r}")
    if wanted == off:
        reason = f"{setting}={off}"
    elif blocked is not None and (reason := blocked()) is not None:
        log.log(blocked_level, "%s: %s", what, reason)
        return None
    else:
        module, why = compile_or_reason(name, source, cflags, includes)
        if module is not None and (cpu_check is None or module.cpu_supported()):
            return module
        reason = f"{subject} {why}" if module is None else cpu_check
    log.warning("%s: %s", what, reason)
    return None


def _prune(name: str, keep: Path) -> None:
    """Remove builds of this kernel that no process has loaded for STALE_DAYS (other sources or torch
    versions; a build of another checkout that is still in use is kept: its loads touch it), and the
    work folders of builds that died (a day old: no live build takes that long)."""
    now = time.time()
    for old in keep.parent.glob(f"{name}-*"):
        try:
            age = now - old.stat().st_mtime
            if old != keep and (age > STALE_DAYS * 86400 or (".tmp" in old.name and age > 86400)):
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass
