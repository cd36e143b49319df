"""This process's mappings as the kernel lists them (/proc/self/maps, /proc/self/smaps): where a file is mapped, and
how much of the mapping holding an address is in anonymous huge pages."""

from __future__ import annotations

from pathlib import Path


def _mappings(smaps: bool):
    """(start, end, path or "", that mapping's smaps lines) for each mapping."""
    text = Path("/proc/self/smaps" if smaps else "/proc/self/maps").read_text()
    current = None
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            if current is not None:
                yield current
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in head.split("-"))
            current = (lo, hi, fields[5] if len(fields) == 6 else "", [])
        elif current is not None:
            current[3].append(line)
    if current is not None:
        yield current


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """[start, end) of every mapping of `path` in this process, merged where they touch."""
    ranges: list[tuple[int, int]] = []
    for lo, hi, name, _ in _mappings(smaps=False):
        if name == str(Path(path).resolve()):
            if ranges and ranges[-1][1] == lo:
                ranges[-1] = (ranges[-1][0], hi)
            else:
                ranges.append((lo, hi))
    return ranges


def anon_huge_bytes(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address`; None where no mapping holds it."""
    for lo, hi, _, lines in _mappings(smaps=True):
        if lo <= address < hi:
            return next((int(x.split()[1]) << 10 for x in lines if x.startswith("AnonHugePages:")), 0)
    return None
