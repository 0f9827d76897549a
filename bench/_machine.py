"""Machine facts and /proc readings shared by the benchmarks (Linux; imported as a sibling module)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def filesystem_of(path: Path) -> str:
    """``fstype on device`` of the mount holding ``path`` (from /proc/mounts), or ``unknown``."""
    best, found = "", "unknown"
    target = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                inside = target == mount or target.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, found = mount, f"{fstype} on {device}"
    except OSError:
        pass
    return found


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def memory_status(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux /proc)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024
