"""Stopping the kernel builds (a server shut down, or Ctrl-C, while it compiles at start-up)."""

import shutil
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
