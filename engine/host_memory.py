"""How much host memory this process may use: its memory cgroup's room and the kernel's MemAvailable."""

from __future__ import annotations

from pathlib import Path


def _cgroup_room(root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")) -> int | None:
    """Bytes left under the memory cgroup this process is in (v1 or v2), if it has a limit: the limit
    minus the working set. The cgroup's usage also counts page cache, and its inactive part (files
    read once: the interpreter's imports, a tokenizer, checkpoint pages already used) is reclaimed
    by the kernel before anything is refused, so it is not counted as used: left in, it moved the
    room by tens of MiB from one start to the next with the same cap (docs/usage/memory.md)."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            base = root / path.lstrip("/")
            limit_f, usage_f, inactive = base / "memory.max", base / "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            base = root / "memory" / path.lstrip("/")
            limit_f, usage_f, inactive = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes", "total_inactive_file"
        else:
            continue
        try:
            raw = limit_f.read_text().strip()
            if raw != "max" and int(raw) < (1 << 60):
                return int(raw) - int(usage_f.read_text().strip()) + _stat(base / "memory.stat", inactive)
        except (OSError, ValueError):
            continue
    return None


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat, 0 when absent or unreadable."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def host_budget(max_host_memory: int | None) -> int:
    """--max-host-memory, or what the cgroup/machine still allows minus a margin for the
    interpreter's own growth, allocator slack and temporaries of the compute."""
    if max_host_memory is not None:
        return max_host_memory
    room = host_memory_available()
    return max(0, room - room // 20 - (128 << 20))


def host_memory_available() -> int:
    """Bytes this process may still use: the tighter of its cgroup's room and MemAvailable."""
    avail = 1 << 62
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    room = _cgroup_room()
    return avail if room is None else min(avail, room)


def anonymous_bytes() -> int:
    """This process's anonymous resident memory now (RssAnon): what a memory budget on the CPU
    bounds; 0 where /proc does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
