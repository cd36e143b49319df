"""Whether this machine can cache a file system's files in huge folios (engine/weights/formats/views.py map_file):
the tests that look for huge pages skip where it cannot."""

from __future__ import annotations

import platform
from pathlib import Path


def _file_system(path: Path) -> str:
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, fs, *_ = line.split()
        if str(path).startswith(point) and len(point) > len(best):
            best, kind = point, fs
    return kind


def no_huge_pages() -> str | None:
    """Why this machine has no transparent huge pages, or None where it has them."""
    if platform.system() != "Linux":
        return "not Linux"
    try:
        if "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text():
            return "transparent huge pages are off"
    except OSError:
        return "a kernel without transparent huge pages"
    return None


def no_large_folios(path: Path) -> str | None:
    """Why this machine cannot cache `path`'s file system in huge folios, or None where it can: transparent
    huge pages not off, and xfs, or ext4 from Linux 6.16 (where ext4 gained large folios)."""
    why = no_huge_pages()
    if why:
        return why
    fs, release = _file_system(path), tuple(int(x) for x in platform.release().split(".")[:2])
    if fs == "xfs" or (fs == "ext4" and release >= (6, 16)):
        return None
    return f"{fs} on Linux {platform.release()} keeps no large folios"


def no_collapse() -> str | None:
    """Why this process cannot collapse its own anonymous memory into huge pages (no transparent huge pages, or
    MADV_COLLAPSE refused: kernels before 6.1), or None where it can."""
    why = no_huge_pages()
    if why:
        return why
    import torch

    from engine.weights.transports.resident_copy import HUGE_PAGE, HugePageCollapse, copied_tensors

    _, raw = copied_tensors({"w": torch.ones(2 * HUGE_PAGE, dtype=torch.uint8)})
    collapse = HugePageCollapse([raw])
    try:
        collapse.wait(60)
    finally:
        collapse.close()
    return None if collapse.refused is None else f"MADV_COLLAPSE refused here (errno {collapse.refused})"
