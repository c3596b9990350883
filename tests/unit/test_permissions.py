"""Start-up and sources refuse what the service's user may not write or read with one line that
names the path and the fix (a container runs as uid 1000; the host directories it mounts keep
their owner). The checks run in a forked child that has dropped to ``nobody``: this suite runs as
root, for whom every permission check passes."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.errors import ConfigurationError, SourceUnreadable
from service.fsutil import ensure_writable_dir
from service.sources.local import check_readable

NOBODY = 65534


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory ``nobody`` can reach (pytest's tmp_path lives under a root-only parent)."""
    path = Path(tempfile.mkdtemp(prefix="modelprep-perm-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


def as_nobody(check: Callable[[], None]) -> str:
    """Run ``check`` as uid/gid 65534 in a forked child; the message of the ServiceError it
    raised, "" if none. Anything else the child hits is reported as such."""
    if os.getuid() != 0:
        pytest.fail("these tests drop privileges: run them as root (as CI does)")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        os.close(read)
        message = ""
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            check()
        except (ConfigurationError, SourceUnreadable) as exc:
            message = f"{type(exc).__name__}: {exc.message}"
        except Exception as exc:  # noqa: BLE001 -- reported to the parent, which fails the test
            message = f"unexpected {type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        out = pipe.read().decode()
    os.waitpid(pid, 0)
    return out


def test_root_owned_data_dir_is_refused_naming_path_and_chown(open_dir: Path) -> None:
    data = open_dir / "data"
    data.mkdir(mode=0o755)
    message = as_nobody(lambda: ensure_writable_dir(data, "MODELPREP_DATA_DIR"))
    assert message.startswith("ConfigurationError: "), message
    assert str(data) in message and f"chown -R {NOBODY}:{NOBODY}" in message
    assert "MODELPREP_DATA_DIR" in message and "\n" not in message


def test_data_dir_that_cannot_be_created_is_refused(open_dir: Path) -> None:
    data = open_dir / "data" / "jobs"
    message = as_nobody(lambda: ensure_writable_dir(data, "MODELPREP_DATA_DIR"))
    assert message.startswith("ConfigurationError: cannot create "), message
    assert str(data) in message


def test_writable_data_dir_is_accepted(open_dir: Path) -> None:
    data = open_dir / "data"
    data.mkdir()
    os.chown(data, NOBODY, NOBODY)
    assert as_nobody(lambda: ensure_writable_dir(data / "jobs", "MODELPREP_DATA_DIR")) == ""
    assert (data / "jobs").is_dir()


def test_unreadable_checkpoint_file_is_named(open_dir: Path) -> None:
    model = open_dir / "model"
    model.mkdir(mode=0o755)
    (model / "config.json").write_text("{}")
    (model / "config.json").chmod(0o644)
    weights = model / "model.safetensors"
    weights.write_bytes(b"x")
    weights.chmod(0o600)
    message = as_nobody(lambda: check_readable(model))
    assert message.startswith("SourceUnreadable: "), message
    assert str(weights) in message and "chmod -R a+rX" in message
    weights.chmod(0o644)
    assert as_nobody(lambda: check_readable(model)) == ""
