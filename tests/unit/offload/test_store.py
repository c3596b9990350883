"""The offload store: its on-disk format, zero-copy references, crash safety, quota, disk full."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from service.checkpoint import open_checkpoint
from service.checkpoint.base import FileRegion
from service.config import Settings
from service.errors import DiskFull, OffloadQuotaExceeded, PathOutsideRoot
from service.offload.paths import job_store_dir
from service.offload.store import (
    OffloadStore,
    OffloadStoreError,
    open_job_store,
)
from service.offload.usage import offload_usage

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_written_tensor_reads_back_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    store = OffloadStore(tmp_path / "s")
    tensor = (torch.randn(3, 5) * 100).to(dtype)
    store.put_tensor("w", tensor)
    assert torch.equal(store.load("w"), tensor)
    assert store.load("w").dtype == dtype


def test_chunked_write_equals_whole_write(tmp_path: Path) -> None:
    store = OffloadStore(tmp_path / "s")
    tensor = torch.randn(10, 7)
    store.put_chunks("w", torch.split(tensor.reshape(-1), 9), torch.float32, (10, 7))
    assert torch.equal(store.load("w"), tensor)
    pieces = list(store.iter_chunks("w", max_bytes=40))
    assert [p.numel() for p in pieces[:2]] == [10, 10]
    assert torch.equal(torch.cat(pieces).reshape(10, 7), tensor)


def test_safetensors_regions_are_referenced_in_place_not_copied(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    store = OffloadStore(tmp_path / "s", allowed_roots=[llama_safetensors_dir])
    with open_checkpoint(llama_safetensors_dir) as ckpt:
        for info in ckpt.reader.tensor_infos():
            region = ckpt.reader.region(info.name)
            assert region is not None
            store.put_reference(info.name, region, info.dtype, info.shape)
        store.commit()
        for info in ckpt.reader.tensor_infos():
            assert torch.equal(store.load(info.name), ckpt.reader.read(info.name))
    assert list((tmp_path / "s" / "data").iterdir()) == []
    metrics = store.metrics()
    assert metrics["bytes_written"] == 0
    assert metrics["tensors_referenced"] == len(store.names())


def test_a_reference_in_parts_reads_as_one_tensor_and_survives_reopen(tmp_path: Path) -> None:
    """A stack packed from tensors of two files (a MoE layer's experts) is referenced in place,
    run after run: every read (whole, rows, chunks) sees the concatenation."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    want = torch.arange(24.0).reshape(4, 6)
    raw = want.numpy().tobytes()
    (ckpt / "a.bin").write_bytes(b"x" * 8 + raw[:40] + raw[64:])  # rows 0-1 minus 2 elements, 3
    (ckpt / "b.bin").write_bytes(raw[40:64])
    regions = [FileRegion(ckpt / "a.bin", 8, 40), FileRegion(ckpt / "b.bin", 0, 24),
               FileRegion(ckpt / "a.bin", 48, 32)]  # fmt: skip
    store = OffloadStore(tmp_path / "s", allowed_roots=[ckpt])
    store.put_reference_parts("w", regions, torch.float32, (4, 6))
    store.commit()
    for opened in (store, OffloadStore(tmp_path / "s")):
        assert torch.equal(opened.load("w"), want)
        assert torch.equal(opened.load_rows("w", 1, 3), want[1:3])
        assert torch.equal(torch.cat(list(opened.iter_chunks("w", 28))), want.reshape(-1))
    assert list((tmp_path / "s" / "data").iterdir()) == []
    assert store.metrics()["bytes_written"] == 0
    with pytest.raises(PathOutsideRoot):
        OffloadStore(tmp_path / "t", allowed_roots=[tmp_path / "other"]).put_reference_parts(
            "w", regions, torch.float32, (4, 6)
        )
    with pytest.raises(OffloadStoreError, match="needs 96"):
        store.put_reference_parts("v", regions[:2], torch.float32, (4, 6))


def test_reference_outside_the_checkpoint_roots_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.bin"
    outside.write_bytes(b"\0" * 16)
    store = OffloadStore(tmp_path / "s", allowed_roots=[tmp_path / "ckpt"])
    with pytest.raises(PathOutsideRoot):
        store.put_reference("w", FileRegion(outside, 0, 16), torch.float32, (4,))


def test_tampered_index_path_cannot_escape_the_store(tmp_path: Path) -> None:
    store = OffloadStore(tmp_path / "s")
    store.put_tensor("w", torch.ones(4))
    store.commit()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\1" * 16)
    index_path = tmp_path / "s" / "index.json"
    index = json.loads(index_path.read_text())
    index["tensors"]["w"]["path"] = "../secret.bin"
    index_path.write_text(json.dumps(index))
    with pytest.raises(PathOutsideRoot):
        OffloadStore(tmp_path / "s").load("w")


def test_index_survives_reopen_and_orphan_data_files_are_removed(tmp_path: Path) -> None:
    store = OffloadStore(tmp_path / "s")
    store.put_tensor("a", torch.arange(6.0))
    store.commit()
    store.put_tensor("b", torch.arange(3.0))  # written but never committed: a crash now
    orphan = tmp_path / "s" / store.entry("b").path
    assert orphan.exists()
    reopened = OffloadStore(tmp_path / "s")
    assert reopened.names() == ["a"]
    assert torch.equal(reopened.load("a"), torch.arange(6.0))
    assert not orphan.exists()
    assert not list((tmp_path / "s").glob(".index.json.*"))


def test_reloads_and_bytes_read_are_counted_and_persisted(tmp_path: Path) -> None:
    store = OffloadStore(tmp_path / "s")
    store.put_tensor("w", torch.zeros(4, 4))
    for _ in range(3):
        store.load("w")
    assert (store.reloads, store.bytes_read) == (3, 3 * 64)
    store.commit()
    store.save_metrics()
    assert (OffloadStore(tmp_path / "s").reloads, OffloadStore(tmp_path / "s").bytes_read) == (
        3,
        192,
    )


def test_quota_fails_only_its_store_while_another_keeps_writing(tmp_path: Path) -> None:
    healthy = OffloadStore(tmp_path / "jobs" / "ok" / "offload")
    greedy = OffloadStore(tmp_path / "jobs" / "greedy" / "offload", quota_bytes=1000)
    errors: list[BaseException] = []

    def fill_greedy() -> None:
        try:
            for i in range(10):
                greedy.put_tensor(f"t{i}", torch.zeros(100))  # 400 bytes each
        except OffloadQuotaExceeded as exc:
            errors.append(exc)

    def fill_healthy() -> None:
        for i in range(10):
            healthy.put_tensor(f"t{i}", torch.full((100,), float(i)))
        healthy.commit()

    threads = [threading.Thread(target=fill_greedy), threading.Thread(target=fill_healthy)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 1 and "quota" in str(errors[0])
    assert not (tmp_path / "jobs" / "greedy" / "offload").exists()
    with pytest.raises(OffloadStoreError, match="aborted"):
        greedy.load("t0")
    for i in range(10):
        assert torch.equal(healthy.load(f"t{i}"), torch.full((100,), float(i)))


def test_referenced_bytes_do_not_count_towards_the_quota(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    store = OffloadStore(tmp_path / "s", quota_bytes=1, allowed_roots=[llama_safetensors_dir])
    with open_checkpoint(llama_safetensors_dir) as ckpt:
        info = ckpt.reader.tensor_infos()[0]
        region = ckpt.reader.region(info.name)
        assert region is not None
        store.put_reference(info.name, region, info.dtype, info.shape)


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
        check=False,
        capture_output=True,
    )
    return probe.returncode == 0


CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from pathlib import Path
    from service.errors import DiskFull
    from service.offload.store import OffloadStore
    root = Path(sys.argv[1])
    small = OffloadStore(root / "jobs" / "small" / "offload")
    small.put_tensor("w", torch.arange(1000.0))
    small.commit()
    big = OffloadStore(root / "jobs" / "big" / "offload")
    outcome = {}
    try:
        big.put_tensor("w", torch.zeros(1 << 20))  # 4 MiB into a 1 MiB filesystem
    except DiskFull as exc:
        outcome["error"] = type(exc).__name__
        outcome["errno_code"] = exc.code
    outcome["big_exists"] = (root / "jobs" / "big" / "offload").exists()
    outcome["small_ok"] = bool(torch.equal(small.load("w"), torch.arange(1000.0)))
    small.put_tensor("v", torch.ones(10))  # space came back: the small job goes on
    small.commit()
    outcome["small_still_writes"] = bool(torch.equal(small.load("v"), torch.ones(10)))
    print(json.dumps(outcome))
    """
)


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare -rm to mount a private tmpfs")
def test_disk_full_on_a_real_small_filesystem_fails_only_that_store(tmp_path: Path) -> None:
    mount = tmp_path / "tiny-fs"
    mount.mkdir()
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    command = (
        f"mount -t tmpfs -o size=1m tmpfs {shlex.quote(str(mount))} && "
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(script))} {shlex.quote(str(mount))}"
    )
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", command],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    outcome = json.loads(proc.stdout.strip().splitlines()[-1])
    assert outcome == {
        "error": DiskFull.__name__,
        "errno_code": "disk_full",
        "big_exists": False,
        "small_ok": True,
        "small_still_writes": True,
    }


def test_job_store_dir_refuses_ids_that_leave_the_jobs_dir(tmp_path: Path) -> None:
    assert job_store_dir(tmp_path, "abc") == tmp_path / "abc" / "offload"
    for bad in ("..", "../x", "", "a/b"):
        with pytest.raises(PathOutsideRoot):
            job_store_dir(tmp_path, bad)


def test_close_removes_the_store_unless_failed_and_kept(tmp_path: Path) -> None:
    kept = Settings(data_dir=tmp_path / "var", keep_failed_offload=True)
    store = open_job_store(kept, "j1", None)
    store.put_tensor("w", torch.ones(2))
    store.commit()
    store.close(failed=True)
    assert store.root.exists()
    store.close(failed=False)
    assert not store.root.exists()
    dropped = open_job_store(Settings(data_dir=tmp_path / "var"), "j2", None)
    dropped.close(failed=True)
    assert not dropped.root.exists()


def test_offload_usage_reports_each_job_and_the_total(
    llama_safetensors_dir: Path, tmp_path: Path
) -> None:
    settings = Settings(data_dir=tmp_path / "var")
    a = open_job_store(settings, "a", llama_safetensors_dir)
    a.put_tensor("w", torch.zeros(1024))  # 4096 bytes, one file
    a.load("w")
    a.commit()
    a.save_metrics()
    b = open_job_store(settings, "b", llama_safetensors_dir)
    with open_checkpoint(llama_safetensors_dir) as ckpt:
        info = ckpt.reader.tensor_infos()[0]
        region = ckpt.reader.region(info.name)
        assert region is not None
        b.put_reference(info.name, region, info.dtype, info.shape)
    b.commit()
    usage = offload_usage(settings)
    assert set(usage["jobs"]) == {"a", "b"}
    ja, jb = usage["jobs"]["a"], usage["jobs"]["b"]
    assert (ja["tensors_written"], ja["reloads"], ja["bytes_read"]) == (1, 1, 4096)
    assert ja["files"] == 3  # data file, index.json, metrics.json
    assert ja["bytes_on_disk"] >= 4096
    assert (jb["tensors_referenced"], jb["bytes_referenced"]) == (1, info.nbytes)
    assert usage["total"]["files"] == ja["files"] + jb["files"]
    assert usage["total"]["stores"] == 2
    assert usage["free_disk_bytes"] > 0


def test_a_crashed_jobs_store_is_discarded_by_job_id(tmp_path: Path) -> None:
    from service.offload.store import discard_job_store

    settings = Settings(data_dir=tmp_path / "var")
    store = open_job_store(settings, "crashed", None)
    store.put_tensor("w", torch.ones(8))
    store.commit()  # the process dies here without close()
    assert discard_job_store(settings, "crashed", failed=True) is True
    assert not store.root.exists()
    kept = Settings(data_dir=tmp_path / "var", keep_failed_offload=True)
    open_job_store(kept, "kept", None).commit()
    assert discard_job_store(kept, "kept", failed=True) is False
    assert (kept.jobs_dir / "kept" / "offload" / "index.json").exists()
    assert discard_job_store(kept, "kept", failed=False) is True
