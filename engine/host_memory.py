"""How much host memory this process may use: its memory cgroup's room and the kernel's MemAvailable."""

from __future__ import annotations

from pathlib import Path


def _cgroup_room() -> int | None:
    """Bytes left under the memory cgroup this process is in (v1 or v2), if it has a limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2 unified hierarchy
            limit_f, usage_f = f"/sys/fs/cgroup{path}/memory.max", f"/sys/fs/cgroup{path}/memory.current"
        elif "memory" in controllers.split(","):
            base = f"/sys/fs/cgroup/memory{path}"
            limit_f, usage_f = f"{base}/memory.limit_in_bytes", f"{base}/memory.usage_in_bytes"
        else:
            continue
        try:
            raw = Path(limit_f).read_text().strip()
            if raw != "max" and int(raw) < (1 << 60):
                return int(raw) - int(Path(usage_f).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


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
