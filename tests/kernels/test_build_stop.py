"""Kernel builds: stopping them (a server shut down, or Ctrl-C, while it compiles at start-up), and where a fresh
build leaves its library."""

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

from engine.kernels import build, prepare


def test_a_compiler_that_starts_after_the_stop_looked_is_stopped_too(tmp_path: Path, monkeypatch):
    """stop_builds() kills the `ninja` processes it finds; a build whose compiler was starting just then (forked,
    not yet exec'd: what a Ctrl-C right as a build begins meets) starts it afterwards. prepare() must stop that
    one too, and return within a second or so, not after the whole compile."""
    monkeypatch.setattr(build, "_stopped", threading.Event())  # this test's stop only
    ninja = tmp_path / "ninja"
    ninja.symlink_to(shutil.which("sleep"))  # a process whose name is "ninja", as torch's build runs

    def late_compiler() -> bool:
        while not build.stopping():  # the stop has looked for compilers and found none
            time.sleep(0.01)
        return subprocess.run([str(ninja), "60"]).returncode == 0  # killed: False

    spec = prepare.KernelSpec("late", "late", Path("late.cpp"), (), (), late_compiler)
    monkeypatch.setattr(prepare, "KERNELS", ((spec,),))
    stopper = threading.Timer(0.5, build.stop_builds)
    stopper.start()
    t0 = time.monotonic()
    choices = prepare.prepare()
    elapsed = time.monotonic() - t0
    stopper.join()
    assert elapsed < 10, f"prepare() waited {elapsed:.0f} s for a compiler started after the stop"
    assert choices == [prepare.KernelChoice("late", False)]  # its compiler was killed, not finished


def test_a_kernel_built_in_this_process_names_the_library_where_it_lies(tmp_path: Path, monkeypatch):
    """A build runs in a work folder of its own, renamed into place once done; the module it returns then says
    where its library is now, not in the work folder that is gone (a check that read module.__file__ after a
    fresh build failed with FileNotFoundError)."""
    import types

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setattr(build, "cache_root", lambda: tmp_path)
    source = tmp_path / "tiny.cpp"
    source.write_text("// a kernel\n")

    def fake_load(name, sources, extra_cflags, build_directory, verbose):  # the compiler's output, without it
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"built")
        return types.SimpleNamespace(__file__=str(library))

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(build, "_ninja_on_path", lambda: None)
    module = build.compile_extension("tiny", source)
    assert Path(module.__file__) == build.build_folder("tiny", source) / "tiny.so"
    assert Path(module.__file__).read_bytes() == b"built"


def test_a_build_that_keeps_starting_compilers_leaves_none_behind(tmp_path: Path, monkeypatch):
    """A ninja starts its next compile the moment one ends; stop_builds() must not leave one running that it
    started between the stop's look at its processes and their kill (such a compile outlives the server).
    Here the "ninja" starts a compiler stand-in every few milliseconds, so that moment is always there."""
    monkeypatch.setattr(build, "_stopped", threading.Event())  # this test's stop only
    marker = "61.4142"  # each stand-in's argument: how the leftovers are found
    ninja = tmp_path / "ninja"
    ninja.write_text(f"#!/bin/sh\nwhile true; do sleep {marker} & sleep 0.002; done\n")
    ninja.chmod(0o755)
    proc = subprocess.Popen([str(ninja)])
    try:
        time.sleep(0.3)
        assert build.stop_builds() > 1
        proc.wait(timeout=10)
        time.sleep(0.3)  # a compiler left running would still be there
        left = _stand_ins(marker)
        assert not left, f"{len(left)} compiler stand-ins outlived the stop"
    finally:
        proc.kill()
        for pid in _stand_ins(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # gone meanwhile


def _stand_ins(marker: str) -> list[int]:
    """The processes running `sleep <marker>`."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().split(b"\0")[1:2] == [marker.encode()]:
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue  # gone meanwhile
    return pids
