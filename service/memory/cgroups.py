"""The memory cgroup this process lives under, and a job's own.

A container or a Kubernetes pod limits memory with a cgroup, not with the host's RAM: a service
that plans with ``/proc/meminfo`` inside a 2.5 GiB pod plans with the host's 64 GiB and is
OOM-killed (or stalls in reclaim) instead of refusing. So:

* :func:`read_memory_limit` reads the limit this process lives under: cgroup v2 ``memory.max``
  and ``memory.high``, cgroup v1 ``memory.limit_in_bytes`` (each up to the hierarchy's root,
  the smallest wins), else the host's ``MemTotal``.
* :class:`JobCgroup` gives a job process group its budget as a memory cgroup of its own, a
  child of the service's cgroup, so that a job over budget is stopped inside its own cgroup
  (cgroup v1: the OOM killer disabled there, the job paused and seen ``under_oom``; v2:
  ``memory.max`` with ``memory.oom.group``) and never pushes the container, API included, into
  reclaim or the container's OOM killer. Where no cgroup can be made,
  :func:`~service.memory.procfs.process_group_private_bytes` lets the executor account for the
  group's memory itself."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from service.memory.budget import MemoryLimit
from service.memory.procfs import _write, host_memory

UNLIMITED = 1 << 62
"""cgroup v1 spells "no limit" as a page-rounded 2^63-1; anything this large is no limit."""

JOB_CGROUP_PREFIX = "modelprep-job-"

SERVICE_LEAF = "modelprep-service"
"""cgroup v2 only: processes may not live in a cgroup whose children have controllers, so the
service moves itself into this leaf before it makes job cgroups beside it."""


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
