"""What ``/proc`` says about memory: the host's total, a process group's private bytes the
kernel cannot drop (the executor's own accounting where no cgroup can be made), this process's resident bytes and peak,
and a child's ``status`` fields."""

from __future__ import annotations

import os
from pathlib import Path


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's ``MemTotal`` in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no MemTotal in {meminfo}")


# --- without a cgroup: the executor's own accounting ----------------------------------------


def process_group_private_bytes(pgid: int, proc: Path = Path("/proc")) -> int:
    """Private bytes the kernel cannot drop, summed over every process in process group
    ``pgid`` (the job and the children it leads): what the group added to the machine's
    memory and would still hold under pressure.

    Per process that is ``Private_Dirty + Swap`` of ``smaps_rollup``: the anonymous pages it
    wrote (heap, stacks, tensors), dirty file pages, shared memory it alone maps, and what of
    those went to swap. ``Private_Clean`` is left out: those are clean pages of files a process
    maps (llama.cpp's ``mmap`` of the GGUF it checks, safetensors read in place) that the
    kernel drops and reads again at will, so counting them failed a job that fits (a 5.46 GiB
    checkpoint's GGUF check "held 2.90 GiB" of a page cache a cgroup would have reclaimed), and
    the rare clean anonymous page (freed with ``MADV_FREE``, or read back from swap and still
    in its swap slot) is as droppable. Pages a job process still shares with the forkserver
    it was forked from (the preloaded libraries) are not counted either, as they cost nothing
    more."""
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # the command in parentheses may hold spaces: the fields after it are fixed
            if int(stat[stat.rindex(")") + 2:].split()[2]) != pgid:
                continue
            rollup = _key_values_kb(entry / "smaps_rollup")
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        total += sum(rollup.get(k, 0) for k in HELD_FIELDS)
    return total

HELD_FIELDS = ("Private_Dirty:", "Swap:")
"""The ``smaps_rollup`` fields :func:`process_group_private_bytes` sums."""

def _key_values_kb(path: Path) -> dict[str, int]:
    """``Key: <n> kB`` lines of a /proc file, in bytes."""
    out: dict[str, int] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[2] == "kB":
            out[parts[0]] = int(parts[1]) * 1024
    return out


# --- this process's peak, per phase ---------------------------------------------------------


def current_rss(proc_self: Path = Path("/proc/self")) -> int | None:
    """This process's resident bytes now."""
    try:
        return int((proc_self / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return None

def status_bytes(proc: Path, *fields: str) -> dict[str, int]:
    """The ``kB`` fields of ``proc``'s ``status`` (``VmHWM``, ``RssAnon``...) in bytes; those
    it lacks, or all of them for a process that has ended, are missing."""
    found: dict[str, int] = {}
    try:
        for line in (proc / "status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in fields:
                found[key] = int(value.split()[0]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return found

def peak_rss(proc_self: Path = Path("/proc/self")) -> int | None:
    """This process's peak resident bytes since it started or since :func:`reset_peak_rss`."""
    return status_bytes(proc_self, "VmHWM").get("VmHWM")

def reset_peak_rss(proc_self: Path = Path("/proc/self")) -> bool:
    """Reset this process's peak RSS to its current RSS (``clear_refs`` 5), so the next
    :func:`peak_rss` is the peak of what came after; False where the kernel cannot."""
    try:
        _write(proc_self / "clear_refs", "5")
    except OSError:
        return False
    return True

def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)
