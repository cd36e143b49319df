"""docs/reference/ is what `python -m layerstream.reference` prints from the code, and every LAYERSTREAM_*
variable in the source tree is described there (engine/env_switches.py, or a `layerstream serve` flag)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
REGENERATE = "python -m layerstream.reference"
# Where LAYERSTREAM_* environment variables are read or set. C++ sources are left out: their
# LAYERSTREAM_* names are preprocessor macros, not variables. Tests are left out: they may invent names.
SCANNED = ("engine/**/*.py", "server/**/*.py", "layerstream/**/*.py", "scripts/*", "docker/*", "Dockerfile",
           "deploy/**/*.yaml")
NAME = re.compile(r"LAYERSTREAM_[A-Z0-9_]*[A-Z0-9]")


def test_reference_pages_are_what_the_generator_prints(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSTREAM_")}
    env["COLUMNS"] = "37"  # a narrow terminal must not change a page
    subprocess.run([sys.executable, "-m", "layerstream.reference", "--out", str(tmp_path)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=240)
    generated = {p.name: p.read_text() for p in tmp_path.glob("*.md")}
    committed = {p.name: p.read_text() for p in REFERENCE.glob("*.md")}
    assert "serve.md" in generated and "environment.md" in generated
    stale = sorted(n for n in generated.keys() | committed.keys() if generated.get(n) != committed.get(n))
    assert not stale, f"docs/reference/ differs from the code in {stale}: run `{REGENERATE}` and commit the result"


def _serve_variables() -> set[str]:
    from server.launch import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {f"LAYERSTREAM_{a.dest.upper()}" for a in parser._actions if a.option_strings and a.dest != "help"}


def _names_in_source() -> dict[str, set[str]]:
    """LAYERSTREAM_* name -> the files it appears in (the registry itself left out)."""
    found: dict[str, set[str]] = {}
    for pattern in SCANNED:
        for path in ROOT.glob(pattern):
            if not path.is_file() or path == ROOT / "engine" / "env_switches.py":
                continue
            for name in NAME.findall(path.read_text(errors="replace")):
                found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_layerstream_variable_is_described():
    from engine.env_switches import SWITCHES

    registry = [s.name for s in SWITCHES]
    assert len(registry) == len(set(registry)), "a name twice in engine/env_switches.py"
    known = set(registry) | _serve_variables()
    found = _names_in_source()
    assert "LAYERSTREAM_PREPACK" in found and "LAYERSTREAM_MAX_DEVICE_MEMORY" in found  # the scan sees the tree
    missing = {n: sorted(files) for n, files in found.items() if n not in known}
    assert not missing, (f"LAYERSTREAM_* names in no table: {missing}; describe each in engine/env_switches.py "
                         f"and run `{REGENERATE}`")
    unused = sorted(set(registry) - set(found))
    assert not unused, f"engine/env_switches.py describes names the source tree no longer has: {unused}"
