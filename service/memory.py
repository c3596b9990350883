"""The memory this process really has, each job's share of it, and a job's own memory cgroup.

A container or a Kubernetes pod limits memory with a cgroup, not with the host's RAM: a service
that plans with ``/proc/meminfo`` inside a 2.5 GiB pod plans with the host's 64 GiB and is
OOM-killed (or stalls in reclaim) instead of refusing. So:

* :func:`read_memory_limit` reads the limit this process lives under: cgroup v2 ``memory.max``
  and ``memory.high``, cgroup v1 ``memory.limit_in_bytes`` (each up to the hierarchy's root,
  the smallest wins), else the host's ``MemTotal``.
* :class:`MemoryBudget` splits it: the API's share (the API process and the job forkserver),
  then the rest divided by the pool size is what one job, with every child it starts, may use.
* :class:`JobCgroup` gives a job process group that budget as a memory cgroup of its own, a
  child of the service's cgroup, so that a job over budget is stopped inside its own cgroup
  (cgroup v1: the OOM killer disabled there, the job paused and seen ``under_oom``; v2:
  ``memory.max`` with ``memory.oom.group``) and never pushes the container, API included, into
  reclaim or the container's OOM killer. Where no cgroup can be made,
  :func:`process_group_private_bytes` lets the executor account for the group's memory itself.

A leaf: it imports nothing of the service but units, so the settings, the executors and the
stages can all read it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

UNLIMITED = 1 << 62
"""cgroup v1 spells "no limit" as a page-rounded 2^63-1; anything this large is no limit."""

JOB_CGROUP_PREFIX = "modelprep-job-"
SERVICE_LEAF = "modelprep-service"
"""cgroup v2 only: processes may not live in a cgroup whose children have controllers, so the
service moves itself into this leaf before it makes job cgroups beside it."""


@dataclass(frozen=True)
class MemoryLimit:
    """The most memory this process may use, and where that figure comes from."""

    bytes: int
    source: str
    """``cgroup2:<dir>/memory.max`` (or ``memory.high``), ``cgroup1:<dir>``, or ``host``."""


@dataclass(frozen=True)
class MemoryBudget:
    """How the limit is shared: the API keeps ``api_share``, each of ``workers`` jobs gets
    ``job`` bytes (its process group: the job process and every child it starts)."""

    limit: int
    limit_source: str
    api_share: int
    workers: int
    job: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_job_budget(limit: int, api_share: int, workers: int) -> int:
    """The limit, less the API's share, divided by the pool size."""
    return max(0, limit - api_share) // workers


# --- reading the limit ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Mount:
    root: str
    """The hierarchy path mounted (``/`` except inside a cgroup namespace's bind mount)."""
    point: Path


def _cgroup_mounts(mountinfo: Path) -> tuple[_Mount | None, _Mount | None]:
    """(the cgroup v2 mount, the cgroup v1 mount holding the memory controller)."""
    v2 = v1 = None
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount = _Mount(root=fields[3], point=Path(fields[4]))
        if tail[0] == "cgroup2" and v2 is None:
            v2 = mount
        elif tail[0] == "cgroup" and "memory" in tail[2].split(",") and v1 is None:
            v1 = mount
    return v2, v1


def _own_paths(proc_cgroup: Path) -> tuple[str | None, str | None]:
    """(this process's cgroup v2 path, its cgroup v1 memory path) from /proc/self/cgroup."""
    v2 = v1 = None
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _directory(mount: _Mount, path: str) -> Path:
    """Where cgroup ``path`` is under ``mount``; the mount point itself when the path is not
    below the mounted root (a cgroup namespace shows ``/``)."""
    root = mount.root.rstrip("/")
    if root and path.startswith(root):
        path = path[len(root):]
    candidate = mount.point / path.lstrip("/")
    return candidate if candidate.is_dir() else mount.point


def _read_bytes(path: Path) -> int | None:
    """A cgroup file's byte count; None for ``max``, no limit, or no file."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit():
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def _smallest_up(directory: Path, top: Path, names: tuple[str, ...]) -> tuple[int, Path] | None:
    """The smallest of the files ``names`` in ``directory`` and each parent up to ``top``."""
    best: tuple[int, Path] | None = None
    current = directory
    while True:
        for name in names:
            value = _read_bytes(current / name)
            if value is not None and (best is None or value < best[0]):
                best = (value, current / name)
        if current == top or top not in current.parents:
            return best
        current = current.parent


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    """The host's ``MemTotal`` in bytes."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise OSError(f"no MemTotal in {meminfo}")


def read_memory_limit(proc: Path = Path("/proc")) -> MemoryLimit:
    """The limit this process lives under: the smallest of its cgroup v2 ``memory.max`` and
    ``memory.high``, its cgroup v1 ``memory.limit_in_bytes`` (its own cgroup's and every
    ancestor's) and the host's memory."""
    best = MemoryLimit(host_memory(proc / "meminfo"), "host")
    v2_mount, v1_mount = _cgroup_mounts(proc / "self" / "mountinfo")
    v2_path, v1_path = _own_paths(proc / "self" / "cgroup")
    if v2_mount is not None and v2_path is not None:
        found = _smallest_up(
            _directory(v2_mount, v2_path), v2_mount.point, ("memory.max", "memory.high")
        )
        if found is not None and found[0] < best.bytes:
            best = MemoryLimit(found[0], f"cgroup2:{found[1]}")
    if v1_mount is not None and v1_path is not None:
        found = _smallest_up(
            _directory(v1_mount, v1_path), v1_mount.point, ("memory.limit_in_bytes",)
        )
        if found is not None and found[0] < best.bytes:
            best = MemoryLimit(found[0], f"cgroup1:{found[1].parent}")
    return best


# --- a job's own cgroup ---------------------------------------------------------------------


def _own_memory_cgroup(proc: Path = Path("/proc")) -> tuple[Literal[1, 2], Path] | None:
    """This process's memory cgroup directory and its version, when the memory controller is
    there to use (v2: ``memory.max`` beside it or enabled for its children)."""
    v2_mount, v1_mount = _cgroup_mounts(proc / "self" / "mountinfo")
    v2_path, v1_path = _own_paths(proc / "self" / "cgroup")
    if v1_mount is not None and v1_path is not None:
        return 1, _directory(v1_mount, v1_path)
    if v2_mount is not None and v2_path is not None:
        directory = _directory(v2_mount, v2_path)
        try:
            controllers = (directory / "cgroup.controllers").read_text().split()
        except OSError:
            return None
        if "memory" in controllers:
            return 2, directory
    return None


def _write(path: Path, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@dataclass(frozen=True)
class JobCgroup:
    """One job's memory cgroup: ``modelprep-job-<id>`` beside (v2) or below (v1) the
    service's own cgroup, limited to the job's budget."""

    version: Literal[1, 2]
    path: Path
    limit: int

    @staticmethod
    def _parent(proc: Path = Path("/proc")) -> tuple[Literal[1, 2], Path] | None:
        own = _own_memory_cgroup(proc)
        if own is None:
            return None
        version, directory = own
        if version == 2 and directory.name == SERVICE_LEAF:
            directory = directory.parent
        return version, directory

    @classmethod
    def create(cls, job_id: str, limit: int) -> JobCgroup:
        """Make the job's cgroup, limited to ``limit`` bytes; :class:`OSError` when this
        process may not (no writable memory controller)."""
        parent = cls._parent()
        if parent is None:
            raise OSError(errno.ENOENT, "no memory cgroup controller for this process")
        version, directory = parent
        if version == 2:
            _enable_v2_children(directory)
        path = directory / f"{JOB_CGROUP_PREFIX}{job_id}"
        path.mkdir(exist_ok=True)
        try:
            if version == 1:
                _write(path / "memory.limit_in_bytes", str(limit))
                with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                    _write(path / "memory.memsw.limit_in_bytes", str(limit))
                # At its limit the job pauses (under_oom) instead of being OOM-killed, and the
                # executor that watches it stops it with a typed error.
                _write(path / "memory.oom_control", "1")
            else:
                _write(path / "memory.max", str(limit))
                with contextlib.suppress(OSError):
                    _write(path / "memory.swap.max", "0")
                _write(path / "memory.oom.group", "1")
        except OSError:
            with contextlib.suppress(OSError):
                path.rmdir()
            raise
        return cls(version, path, limit)

    @classmethod
    def existing(cls, job_id: str) -> JobCgroup | None:
        """The cgroup :meth:`create` made for ``job_id``, seen from the service or the job."""
        parent = cls._parent()
        if parent is None:
            return None
        version, directory = parent
        path = directory / f"{JOB_CGROUP_PREFIX}{job_id}"
        if directory.name == path.name:  # seen from inside the job (v1): its own cgroup
            path = directory
        if not path.is_dir():
            return None
        limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
        return cls(version, path, _read_bytes(path / limit_file) or 0)

    def enter(self, pid: int = 0) -> None:
        """Move process ``pid`` (0: this one) into the cgroup; what it starts follows."""
        _write(self.path / "cgroup.procs", str(pid or os.getpid()))

    def usage(self) -> int:
        """Bytes charged now (page cache included)."""
        name = "memory.usage_in_bytes" if self.version == 1 else "memory.current"
        return _read_bytes(self.path / name) or 0

    def peak(self) -> int | None:
        """Most bytes charged since creation or :meth:`reset_peak` (None: kernel lacks it)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return _read_bytes(self.path / name)

    def reset_peak(self) -> None:
        """Start a new peak (one per phase); a no-op where the kernel cannot."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        with contextlib.suppress(OSError):
            _write(self.path / name, "0")

    def out_of_memory(self) -> bool:
        """Whether the job hit its limit with nothing left to reclaim: paused under OOM (v1)
        or OOM-killed in its cgroup (v2)."""
        if self.version == 1:
            fields = _key_values(self.path / "memory.oom_control")
            return fields.get("under_oom", 0) > 0 or fields.get("oom_kill", 0) > 0
        return _key_values(self.path / "memory.events").get("oom_kill", 0) > 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (a child that left the job's process group
        included)."""
        if self.version == 2 and (self.path / "cgroup.kill").exists():
            with contextlib.suppress(OSError):
                _write(self.path / "cgroup.kill", "1")
                return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        """Remove the (empty) cgroup. Its page cache is reclaimed first: removed with it, the
        charges would go to the service's cgroup, whose limit the API lives under."""
        with contextlib.suppress(OSError):
            if self.version == 1:
                _write(self.path / "memory.force_empty", "0")
            else:
                _write(self.path / "memory.reclaim", str(max(self.usage(), 1)))
        with contextlib.suppress(OSError):
            self.path.rmdir()


def _key_values(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _enable_v2_children(directory: Path) -> None:
    """Let ``directory``'s children have a memory controller: move its own processes into
    the :data:`SERVICE_LEAF` child first (a cgroup v2 with processes cannot give its children
    controllers), then enable ``+memory`` for its subtree."""
    control = directory / "cgroup.subtree_control"
    if "memory" in control.read_text().split():
        return
    leaf = directory / SERVICE_LEAF
    leaf.mkdir(exist_ok=True)
    for pid in (directory / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError, OSError):
            _write(leaf / "cgroup.procs", pid)
    _write(control, "+memory")


def stale_job_cgroups() -> Iterator[Path]:
    """Job cgroups left by a service that stopped (their jobs are gone or re-queued)."""
    parent = JobCgroup._parent()
    if parent is None:
        return
    _, directory = parent
    with contextlib.suppress(OSError):
        yield from directory.glob(f"{JOB_CGROUP_PREFIX}*")


# --- without a cgroup: the executor's own accounting ----------------------------------------


def process_group_private_bytes(pgid: int, proc: Path = Path("/proc")) -> int:
    """Private resident bytes of every process in process group ``pgid`` (the job and the
    children it leads): what the group added to the machine's memory. Pages a job process
    still shares with the forkserver it was forked from (the preloaded libraries) are not
    counted, as they cost nothing more."""
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
        total += sum(rollup.get(k, 0) for k in ("Private_Clean:", "Private_Dirty:", "Swap:"))
    return total


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
