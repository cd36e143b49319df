"""The host room a plan gets under a memory cgroup: the limit minus the working set, so reclaimable
page cache (inactive files) does not shrink it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.host_memory import _cgroup_room

MiB = 1 << 20


def _fake(tmp_path: Path, version: int, limit: str, usage: int, inactive: int | None) -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    if version == 1:
        base = root / "memory" / "bench"
        names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        membership = "7:memory:/bench\n4:pids:/\n"
    else:
        base = root / "bench"
        names = ("memory.max", "memory.current", "inactive_file")
        membership = "0::/bench\n"
    base.mkdir(parents=True)
    (base / names[0]).write_text(limit + "\n")
    (base / names[1]).write_text(f"{usage}\n")
    if inactive is not None:
        (base / "memory.stat").write_text(f"cache 1\n{names[2]} {inactive}\nactive_file 5\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(membership)
    return root, proc


@pytest.mark.parametrize("version", [1, 2])
def test_room_is_the_limit_minus_the_working_set(tmp_path, version):
    root, proc = _fake(tmp_path, version, str(600 * MiB), 500 * MiB, 40 * MiB)
    assert _cgroup_room(root, proc) == 140 * MiB  # 600 - (500 - 40 reclaimable)


def test_room_without_a_stat_file_counts_all_usage(tmp_path):
    root, proc = _fake(tmp_path, 1, str(600 * MiB), 500 * MiB, None)
    assert _cgroup_room(root, proc) == 100 * MiB


def test_no_limit_means_no_cgroup_room(tmp_path):
    root, proc = _fake(tmp_path, 2, "max", 500 * MiB, 40 * MiB)
    assert _cgroup_room(root, proc) is None
