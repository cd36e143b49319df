"""Print a wheel's dependencies (its Requires-Dist) as a pip requirements file, with those of the
extras named in the second argument (comma-separated). The image installs these in a layer of
their own, which a source change leaves cached: the file only changes with pyproject.toml's
dependencies.

    python docker/requirements.py dist/layerstream-*.whl "ray" > requirements.txt
"""

import re
import sys
import zipfile
from email.parser import Parser


def requirements(wheel: str, extras: set[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(z.read(name).decode())
    out = []
    for line in metadata.get_all("Requires-Dist") or []:
        requirement, _, marker = line.partition(";")
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", marker)
        if extra is None:
            out.append(line.strip())
        elif extra.group(1) in extras:
            out.append(requirement.strip())  # (its marker names only the extra)
    return out


if __name__ == "__main__":
    wanted = {e.strip() for e in (sys.argv[2] if len(sys.argv) > 2 else "").split(",") if e.strip()}
    print("\n".join(requirements(sys.argv[1], wanted)))
