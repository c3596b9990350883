"""The CLI client's pure parts: export shorthand, sources, exit codes, progress rendering."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest

from service.cli.client_commands import (
    EXIT_AUTH,
    EXIT_LIMITED,
    EXIT_NOT_FOUND,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ProgressView,
    exit_code_for,
    parse_export,
    source_uri,
)
from service.client import JobEvent, _confined
from service.errors import ApiError, ArtifactCorrupt, ClientError, ServiceUnreachable


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("safetensors", {"format": "safetensors"}),
        ("safetensors:bfloat16", {"format": "safetensors", "dtype": "bfloat16"}),
        ("gguf:q8_0", {"format": "gguf", "type": "q8_0"}),
        ("nnef:q4_0", {"format": "nnef", "compression": "q4_0"}),
        ("safetensors:dtype=float16,max_shard_size=2GB",
         {"format": "safetensors", "dtype": "float16", "max_shard_size": "2GB"}),
        ('{"format": "gguf", "type": "f16"}', {"format": "gguf", "type": "f16"}),
    ],
)
def test_export_shorthands(text: str, spec: dict[str, str]) -> None:
    assert parse_export(text) == spec


@pytest.mark.parametrize("text", ["onnx:opset17", ":bfloat16", '{"type": "f16"}', "{nope",
                                  "safetensors:=bfloat16", "gguf:type=f16,oops"])
def test_bad_export_specs_are_usage_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_export(text)


def test_local_paths_become_file_uris(tmp_path: Path) -> None:
    assert source_uri(str(tmp_path)) == f"file://{tmp_path}"
    assert source_uri("hf://org/model") == "hf://org/model"


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ApiError("x", 401, {}), EXIT_AUTH),
        (ApiError("x", 403, {}), EXIT_AUTH),
        (ApiError("x", 404, {"type": "/problems/job_not_found"}), EXIT_NOT_FOUND),
        (ApiError("x", 404, {"type": "/problems/not_found"}), EXIT_UNAVAILABLE),
        (ApiError("x", 404, {}), EXIT_UNAVAILABLE),
        (ApiError("x", 410, {"type": "/problems/artifact_gone"}), EXIT_NOT_FOUND),
        (ApiError("x", 429, {}), EXIT_LIMITED),
        (ApiError("x", 422, {}), EXIT_USAGE),
        (ApiError("x", 503, {}), EXIT_UNAVAILABLE),
        (ServiceUnreachable("x"), EXIT_UNAVAILABLE),
        (ArtifactCorrupt("x"), EXIT_UNAVAILABLE),
        (ClientError("x"), EXIT_USAGE),
    ],
)
def test_exit_codes(error: ClientError, code: int) -> None:
    assert exit_code_for(error) == code


def event(kind: str, status: str, phase: str, done: int, total: int | None) -> JobEvent:
    return JobEvent(kind, 1, {"id": "j1", "status": status, "phase": phase,
                              "progress": {"done": done, "total": total, "unit": "bytes"}})


def test_progress_on_a_terminal_is_one_bar_per_phase() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=True)
    view(event("phase", "running", "export", 0, 2048))
    view(event("progress", "running", "export", 1024, 2048))
    view(event("phase", "running", "finalize", 0, None))
    view(event("status", "succeeded", "done", 0, None))
    text = out.getvalue()
    assert "export    [###############---------------]  50.0% 1.0 KiB/2.0 KiB" in text
    assert text.count("\n") == 4 and text.endswith("succeeded\n")


def test_progress_without_a_terminal_is_plain_lines_per_change() -> None:
    out = io.StringIO()
    view = ProgressView(out, tty=False)
    view(event("status", "running", "read", 0, None))
    view(event("progress", "running", "read", 10, None))
    view(event("status", "failed", "read", 10, None))
    assert out.getvalue().splitlines() == ["j1 running read 0 B", "j1 failed read 10 B"]


@pytest.mark.parametrize("path", ["../x", "/etc/passwd", "a/../../b", ""])
def test_downloads_stay_in_the_output_directory(tmp_path: Path, path: str) -> None:
    with pytest.raises(ClientError):
        _confined(tmp_path, path)


@pytest.mark.parametrize(
    ("typed", "root"),
    [
        ("localhost:8765", "http://localhost:8765"),
        ("http://host:8765/v1", "http://host:8765"),
        ("https://host/prefix/v1/", "https://host/prefix"),
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000"),
    ],
)
def test_the_service_root_from_what_a_user_types(typed: str, root: str) -> None:
    from service.client import service_root

    assert service_root(typed) == root


def test_an_unsupported_scheme_says_how_to_change_the_url() -> None:
    from service.client import service_root

    with pytest.raises(ClientError, match="MODELPREP_URL"):
        service_root("ftp://host")
