"""The assumption service.shims.multiprocessing makes about the forkserver, named in the
failure message so that a Python upgrade that breaks it says which."""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.connection import Connection


def _report(conn: Connection) -> None:
    from service.shims.multiprocessing import alive_fd, release_forkserver

    fd = alive_fd()
    is_open = fd is not None and _is_open(fd)
    release_forkserver()
    conn.send((fd is not None, is_open, alive_fd(), fd is not None and _is_open(fd)))
    conn.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_forkserver_child_holds_the_alive_fd_and_release_closes_it() -> None:
    ctx = multiprocessing.get_context("forkserver")
    parent, child = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_report, args=(child,))
    process.start()
    child.close()
    assert parent.poll(60), "the forkserver child never answered"
    held, was_open, after, still_open = parent.recv()
    process.join(60)
    assert held and was_open, (
        "assumption broken: a forkserver child inherits "
        "multiprocessing.forkserver._forkserver._forkserver_alive_fd as an open descriptor"
    )
    assert (after, still_open) == (None, False), "release_forkserver left the alive fd open"
