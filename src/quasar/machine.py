"""The memory this process holds and may still take (Linux's /proc and cgroup files), in one leaf module: the server's
metrics and warnings and the calibration's checks read it."""

from __future__ import annotations

import os
import re
from pathlib import Path


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def available_bytes() -> int | None:
    """Memory this process could still take: Linux's MemAvailable, less where a cgroup (a container) allows less;
    None where it cannot be read."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        free = int(re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE).group(1)) * 1024
    except (OSError, AttributeError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            stat = Path("/sys/fs/cgroup/memory.stat").read_text()
            cache = re.search(r"^inactive_file (\d+)$", stat, re.MULTILINE)  # page cache the kernel can drop
            free = min(free, int(limit) - used + (int(cache.group(1)) if cache else 0))
    except (OSError, ValueError):
        pass
    return max(0, free)
