"""This machine's RAM and the share of it the exact host store may take (the planner's host rule and the
cache's pinned allocation read the same numbers)."""
from __future__ import annotations

import os

HOST_RESERVE_FRACTION = 0.10  # fraction of RAM left to the OS, the Python process, tokenizer and documents


def machine_ram_bytes() -> tuple[int, int]:
    """(total, available) RAM of this machine, from /proc/meminfo, else os.sysconf."""
    try:
        info = {}
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        return info["MemTotal"], info.get("MemAvailable", info["MemTotal"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            available = total
        return total, available


def host_usable_bytes(host_ram_bytes: int) -> int:
    """Host RAM usable for the pinned exact store."""
    return int(host_ram_bytes * (1 - HOST_RESERVE_FRACTION))


def pinnable_bytes() -> int:
    """Bytes that may be pinned now: what is available, less the reserve of the total the planner keeps."""
    total, available = machine_ram_bytes()
    return available - int(total * HOST_RESERVE_FRACTION)
