"""The shared download cache: one fill per key across processes, LRU eviction, leases."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.errors import InvalidRequest
from service.sources.cache import DownloadCache, Fill, release, release_all

REPO_ROOT = Path(__file__).resolve().parents[3]

# A child process that acquires one entry (its fill sleeps, writes 100 bytes and appends to a
# log of fills), prints "held", and keeps the entry until its stdin closes.
_CHILD = """
import sys, time
from pathlib import Path
from service.sources.cache import DownloadCache
root, key, log = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
def fill(files):
    with log.open("a") as f:
        f.write(key + "\\n")
    time.sleep(float(sys.argv[4]))
    (files / "blob").write_bytes(b"x" * 100)
    return 100
entry = DownloadCache(root, 10**9).acquire(key, fill)
print("held", entry.hit, flush=True)
sys.stdin.read()
"""


def _child(root: Path, key: str, log: Path, sleep: float = 0.0) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root), key, str(log), str(sleep)],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )


def _fill_bytes(n: int, calls: list[Path]) -> Fill:
    def fill(files: Path) -> int:
        calls.append(files)
        (files / "blob").write_bytes(b"x" * n)
        return n
    return fill


@pytest.fixture(autouse=True)
def _release_leases() -> Iterator[None]:
    yield
    release_all()


def test_second_acquire_is_a_hit_without_filling(tmp_path: Path) -> None:
    cache, calls = DownloadCache(tmp_path, 10**6), list[Path]()
    first = cache.acquire("k1", _fill_bytes(10, calls))
    second = cache.acquire("k1", _fill_bytes(10, calls))
    assert (first.hit, first.bytes_downloaded) == (False, 10)
    assert (second.hit, second.bytes_downloaded) == (True, 0)
    assert len(calls) == 1
    assert (second.path / "blob").read_bytes() == b"x" * 10


def test_failed_fill_is_not_published_and_is_retried(tmp_path: Path) -> None:
    cache = DownloadCache(tmp_path, 10**6)

    def broken(files: Path) -> int:
        (files / "partial").write_bytes(b"half")
        raise ConnectionError("cut")

    with pytest.raises(ConnectionError):
        cache.acquire("k", broken)
    seen: list[list[str]] = []

    def resume(files: Path) -> int:
        seen.append(sorted(p.name for p in files.iterdir()))
        return 0

    assert cache.acquire("k", resume).hit is False
    assert seen == [["partial"]]  # the next fill finds what the interrupted one left


def test_least_recently_used_entries_are_evicted_first(tmp_path: Path) -> None:
    cache, calls = DownloadCache(tmp_path, 250), list[Path]()
    for key in ("a", "b"):
        cache.acquire(key, _fill_bytes(100, calls))
        release(key)
        time.sleep(0.01)
    os.utime(cache.entry_dir("a") / "entry.json")  # "a" used after "b"
    cache.acquire("c", _fill_bytes(100, calls), expected_bytes=100)
    assert cache.entry_dir("a").exists() and cache.entry_dir("c").exists()
    assert not cache.entry_dir("b").exists()
    assert cache.usage() <= 250


def test_entry_held_by_another_process_is_never_evicted(tmp_path: Path) -> None:
    log = tmp_path / "fills.log"
    child = _child(tmp_path / "cache", "held", log)
    try:
        assert child.stdout is not None and child.stdout.readline().startswith("held")
        cache = DownloadCache(tmp_path / "cache", 0)
        assert cache.evict() == []
        assert (cache.entry_dir("held") / "files" / "blob").exists()
    finally:
        child.communicate("")
    assert DownloadCache(tmp_path / "cache", 0).evict() == ["held"]


def test_entry_held_by_this_process_is_never_evicted(tmp_path: Path) -> None:
    cache = DownloadCache(tmp_path, 0)
    cache.acquire("mine", _fill_bytes(10, []))
    assert cache.evict() == []
    release("mine")
    assert cache.evict() == ["mine"]


def test_concurrent_processes_fill_a_key_once(tmp_path: Path) -> None:
    log = tmp_path / "fills.log"
    children = [_child(tmp_path / "cache", "shared", log, sleep=0.5) for _ in range(2)]
    try:
        hits = []
        for child in children:
            assert child.stdout is not None
            hits.append(child.stdout.readline().split()[1])
    finally:
        for child in children:
            child.communicate("")
    assert log.read_text().splitlines() == ["shared"]
    assert sorted(hits) == ["False", "True"]


@pytest.mark.parametrize("key", ["../x", "a/b", "", ".hidden", "a..b"])
def test_keys_cannot_escape_the_cache(tmp_path: Path, key: str) -> None:
    with pytest.raises(InvalidRequest):
        DownloadCache(tmp_path, 10).entry_dir(key)
