"""The one crash-safe JSON writer every index and manifest goes through."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from service.fsutil import atomic_write_json, sha256_file


def test_atomic_json_returns_the_sha256_of_exactly_the_bytes_on_disk(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "index.json"
    digest = atomic_write_json(path, {"b": 1, "a": [1, 2]})
    raw = path.read_bytes()
    assert digest == hashlib.sha256(raw).hexdigest() == sha256_file(path)
    assert raw.endswith(b"\n") and raw.index(b'"a"') < raw.index(b'"b"')  # sorted, readable


def test_compact_json_has_no_indentation_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    atomic_write_json(path, {"tensors": {"w": [1, 2]}}, compact=True)
    assert path.read_text() == '{"tensors":{"w":[1,2]}}'
    assert json.loads(path.read_text()) == {"tensors": {"w": [1, 2]}}


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    atomic_write_json(path, {"old": True})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"new": object()})
    assert json.loads(path.read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.json"]
