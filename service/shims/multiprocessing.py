"""The one private name of the standard library's multiprocessing this service touches.

Assumption (checked by tests/unit/shims/test_multiprocessing.py; Python is capped by
``requires-python`` in pyproject.toml): a child forked by the forkserver inherits
``multiprocessing.forkserver._forkserver._forkserver_alive_fd``, the forkserver's "alive" pipe,
as an open file descriptor, and multiprocessing offers no public way to close it.
"""

from __future__ import annotations

import os
from multiprocessing import forkserver


def alive_fd() -> int | None:
    """The forkserver "alive" descriptor this process holds (None: it holds none)."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    return fd if isinstance(fd, int) else None


def release_forkserver() -> None:
    """Close the forkserver's "alive" pipe that multiprocessing hands every forked child.

    While any child holds it the forkserver outlives the service; closed, the forkserver exits
    as soon as the service's end closes (even on SIGKILL), and with it every job process."""
    fd = alive_fd()
    if fd is not None:
        os.close(fd)
        forkserver._forkserver._forkserver_alive_fd = None  # type: ignore[attr-defined]
