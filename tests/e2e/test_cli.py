"""The ``modelprep`` client commands as a user runs them: real subprocesses against a real
server process on loopback, with API keys; exit codes as documented in service/cli/client_commands.py."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.api.auth import key_digest
from tests.fixtures.http_server import FileServer, Route
from tests.fixtures.models import build_checkpoint, copy_tree, truncate_file
from tests.fixtures.service import ServiceProcess, free_port, running_service

KEY = "mp_cli-tenant-key-0123456789abcdef"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("models")
    build_checkpoint(root / "llama", "llama", "safetensors")
    truncate_file(copy_tree(root / "llama", root / "truncated") / "model.safetensors")
    return root


@pytest.fixture(scope="module")
def service(root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    keys = json.dumps([{"tenant": "cli", "sha256": key_digest(KEY)}])
    with running_service(tmp_path_factory.mktemp("data"), [root],
                         env={"MODELPREP_API_KEYS": keys}) as svc:
        yield svc


def modelprep(
    *args: str, url: str, key: str | None = KEY, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the CLI as a user would, server and key from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELPREP_")}
    env["MODELPREP_URL"] = url
    if key is not None:
        env["MODELPREP_API_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args], env=env, cwd=cwd, capture_output=True,
        text=True, timeout=300, check=False,
    )


@pytest.fixture(scope="module")
def finished(service: ServiceProcess, root: Path) -> tuple[str, subprocess.CompletedProcess[str]]:
    """``submit --wait`` of a good checkpoint given as a local path, export in shorthand."""
    result = modelprep(
        "submit", str(root / "llama"), "--export", "safetensors:bfloat16", "--wait",
        url=service.url,
    )
    return result.stdout.strip(), result


def test_submit_wait_prints_the_id_and_exits_0(
    finished: tuple[str, subprocess.CompletedProcess[str]], service: ServiceProcess, root: Path
) -> None:
    job_id, result = finished
    assert result.returncode == 0, result.stderr
    assert len(job_id) == 32
    # stderr is not a terminal: one plain line per status or phase change, the last one final
    lines = result.stderr.strip().splitlines()
    assert lines[-1].startswith(f"{job_id} succeeded done")
    status = modelprep("status", job_id, url=service.url)
    job: dict[str, Any] = json.loads(status.stdout)
    assert status.returncode == 0 and job["status"] == "succeeded"
    assert job["request"]["source"] == f"file://{root / 'llama'}"
    assert job["request"]["exports"][0]["dtype"] == "bfloat16"


def test_jobs_lists_the_tenants_jobs(
    finished: tuple[str, subprocess.CompletedProcess[str]], service: ServiceProcess
) -> None:
    job_id, _ = finished
    table = modelprep("jobs", "--status", "succeeded", url=service.url)
    assert table.returncode == 0 and job_id in table.stdout
    as_json = modelprep("jobs", "--json", "--limit", "1", url=service.url)
    assert [json.loads(line)["id"] for line in as_json.stdout.splitlines()] == [job_id]


def test_download_checks_digests_and_resumes_a_partial_file(
    finished: tuple[str, subprocess.CompletedProcess[str]], service: ServiceProcess,
    tmp_path: Path,
) -> None:
    job_id, _ = finished
    job = json.loads(modelprep("status", job_id, url=service.url).stdout)
    out = tmp_path / "out"
    first = modelprep("download", job_id, "-o", str(out), url=service.url)
    assert first.returncode == 0, first.stderr
    for artifact in job["artifacts"]:
        data = (out / artifact["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == artifact["sha256"]

    # An interrupted download: the first half of the weights in a .part file, no final file.
    weights = next(a for a in job["artifacts"] if a["path"].endswith("model.safetensors"))
    target = out / weights["path"]
    data = target.read_bytes()
    target.unlink()
    half = len(data) // 2
    target.with_name(target.name + ".part").write_bytes(data[:half])
    second = modelprep("download", job_id, "-o", str(out), url=service.url)
    assert second.returncode == 0, second.stderr
    assert target.read_bytes() == data
    assert not target.with_name(target.name + ".part").exists()
    service.wait_for_records(
        lambda e: weights["path"] in json.dumps(e) and e.get("status") == 206,
        what="the resumed download asked for the missing range only (a 206 access line)",
    )

    # A .part that is not a prefix of the artifact fails the digest check and is removed.
    target.unlink()
    target.with_name(target.name + ".part").write_bytes(b"\0" * half)
    corrupt = modelprep("download", job_id, "-o", str(out), url=service.url)
    assert corrupt.returncode == 4 and "expected" in corrupt.stderr
    assert not target.exists() and not target.with_name(target.name + ".part").exists()


def test_a_failed_job_exits_1_with_its_error(service: ServiceProcess, root: Path) -> None:
    result = modelprep("submit", f"file://{root / 'truncated'}", "-e", "safetensors", "--wait",
                       url=service.url)
    assert result.returncode == 1
    assert "failed: corrupt_checkpoint" in result.stderr
    job_id = result.stdout.strip()
    assert modelprep("wait", job_id, url=service.url).returncode == 1
    assert modelprep("download", job_id, url=service.url).returncode == 1


def test_cancel_then_wait_exits_3(
    service: ServiceProcess, root: Path, http_server: FileServer
) -> None:
    # a source that trickles in: the job is still running when the cancel arrives
    weights = (root / "llama" / "model.safetensors").read_bytes()
    url = http_server.add("/slow/model.safetensors", Route(body=weights, bytes_per_second=20_000))
    submitted = modelprep("submit", url, "-e", "safetensors", url=service.url)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    cancelled = modelprep("cancel", job_id, url=service.url)
    assert cancelled.returncode == 0 and cancelled.stdout.startswith(job_id)
    waited = modelprep("wait", job_id, url=service.url)
    assert waited.returncode == 3 and "cancelled" in waited.stderr


@pytest.mark.parametrize(
    ("args", "key", "code"),
    [
        (("jobs",), "mp_wrong-key", 5),
        (("jobs",), None, 5),
        (("status", "0" * 32), KEY, 6),
        (("submit", "file:///nowhere", "-e", "safetensors"), KEY, 2),
        (("submit", "x", "-e", "onnx:opset"), KEY, 2),
        (("submit", "x"), KEY, 2),
    ],
    ids=["wrong-key", "no-key", "unknown-job", "refused-source", "bad-export", "no-export"],
)
def test_exit_codes_say_what_happened(
    service: ServiceProcess, args: tuple[str, ...], key: str | None, code: int
) -> None:
    result = modelprep(*args, url=service.url, key=key)
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr


def test_submit_passes_a_callback_which_this_service_cannot_sign_for_the_tenant(
    service: ServiceProcess, root: Path
) -> None:
    result = modelprep("submit", str(root / "llama"), "-e", "safetensors",
                       "--callback", "https://hooks.example.com/modelprep", url=service.url)
    assert result.returncode == 2, result.stderr
    assert "MODELPREP_CALLBACK_SECRETS" in result.stderr and "Traceback" not in result.stderr


def test_an_unreachable_service_exits_4() -> None:
    result = modelprep("status", "0" * 32, url=f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 4 and "Traceback" not in result.stderr


def test_keygen_prints_a_key_that_the_service_accepts(tmp_path: Path) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "service.cli", "keygen", "--tenant", "team-x", "--admin", "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    generated = json.loads(made.stdout)
    assert generated["entry"]["admin"] is True and generated["entry"]["tenant"] == "team-x"
    env = {"MODELPREP_API_KEYS": json.dumps([generated["entry"]])}
    with running_service(tmp_path / "data", env=env) as svc:
        ok = modelprep("jobs", url=svc.url, key=generated["key"])
        assert ok.returncode == 0, ok.stderr
        assert modelprep("jobs", url=svc.url, key=None).returncode == 5
    bad = subprocess.run([sys.executable, "-m", "service.cli", "keygen", "--tenant", "a b"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "invalid tenant" in bad.stderr


def test_wait_survives_a_service_restart(root: Path, tmp_path: Path) -> None:
    """The stream drops when the service stops; ``wait`` reconnects with Last-Event-ID to the
    restarted service (which re-queues the interrupted job) and still reports the outcome."""
    keys = json.dumps([{"tenant": "cli", "sha256": key_digest(KEY)}])
    env, port, data = {"MODELPREP_API_KEYS": keys}, free_port(), tmp_path / "data"
    with running_service(data, [root], env=env, port=port) as first:
        job_id = modelprep("submit", str(root / "llama"), "-e", "safetensors",
                           url=first.url).stdout.strip()
        waiting = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "wait", job_id],
            env={**os.environ, "MODELPREP_URL": first.url, "MODELPREP_API_KEY": KEY},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert waiting.stderr is not None
        first_line = waiting.stderr.readline()  # the stream is up: the job's first event
        assert first_line.startswith(job_id), first_line
    with running_service(data, [root], env=env, port=port):
        _, stderr = waiting.communicate(timeout=240)
    assert waiting.returncode == 0, stderr
    assert f"{job_id} succeeded done" in stderr


# --- the first hour (issue 24): no silent failure, every error says what was tried ----------


def one_line(stderr: str) -> str:
    """The single line a failed command writes on stderr (no traceback, no noise)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_cancel_refuses_a_finished_job_delete_removes_its_files_and_jobs_says_deleted(
    service: ServiceProcess, root: Path, tmp_path: Path
) -> None:
    submitted = modelprep("submit", str(root / "llama"), "-e", "safetensors:float16", "--wait",
                          "-q", url=service.url)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()

    cancel = modelprep("cancel", job_id, url=service.url)
    assert cancel.returncode == 2
    assert f"modelprep delete {job_id}" in one_line(cancel.stderr)
    job = json.loads(modelprep("status", job_id, url=service.url).stdout)
    assert job["artifacts"] and "deleted_at" not in job, "cancel must not remove a job's files"

    delete = modelprep("delete", job_id, url=service.url)
    assert delete.returncode == 0, delete.stderr
    assert "files deleted" in delete.stdout
    listed = modelprep("jobs", "--limit", "500", url=service.url).stdout.splitlines()
    row = next(line for line in listed if line.startswith(job_id))
    assert row.split()[1] == "deleted", row

    out = tmp_path / "out"
    download = modelprep("download", job_id, "-o", str(out), url=service.url)
    assert download.returncode == 6
    assert "deleted" in one_line(download.stderr)
    assert not out.exists()


def test_jobs_piped_into_a_reader_that_stops_early_is_quiet(
    service: ServiceProcess, root: Path, finished: tuple[str, subprocess.CompletedProcess[str]]
) -> None:
    """``modelprep jobs --json | head -1``: the pipe closes while the CLI still writes."""
    import fcntl

    def listing_size() -> int:
        return len(modelprep("jobs", "--json", "--limit", "500", url=service.url).stdout)

    # more output than the pipe (shrunk to one page) and Python's buffer hold together
    while listing_size() < 40_000:
        reused = modelprep("submit", str(root / "llama"), "-e", "safetensors:bfloat16",
                           "--wait", "-q", url=service.url)
        assert reused.returncode == 0, reused.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELPREP_")}
    env.update(MODELPREP_URL=service.url, MODELPREP_API_KEY=KEY)
    reader = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "jobs", "--json", "--limit", "500"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None and reader.stderr is not None
    fcntl.fcntl(reader.stdout.fileno(), fcntl.F_SETPIPE_SZ, 4096)
    assert json.loads(reader.stdout.readline())["id"]
    reader.stdout.close()  # what `head -1` does after its line
    stderr = reader.stderr.read().decode()
    reader.wait(timeout=60)
    assert stderr == "", stderr
    assert reader.returncode in (0, -13), reader.returncode  # done, or SIGPIPE as filters end


def test_an_unreachable_service_is_named_with_how_to_change_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = modelprep("jobs", url=url)
    assert result.returncode == 4
    line = one_line(result.stderr)
    assert url in line and "--url" in line and "MODELPREP_URL" in line


@pytest.mark.parametrize("form", ["{host}:{port}", "http://{host}:{port}/v1", "http://{host}:{port}/"])
def test_the_service_url_may_omit_the_scheme_or_end_in_v1(
    service: ServiceProcess, form: str
) -> None:
    host, port = service.url.removeprefix("http://").split(":")
    result = modelprep("jobs", url=form.format(host=host, port=port))
    assert result.returncode == 0, result.stderr


def test_a_url_that_is_not_the_service_root_is_not_reported_as_a_missing_job(
    service: ServiceProcess,
) -> None:
    result = modelprep("status", "0" * 32, url=f"{service.url}/somewhere")
    assert result.returncode == 4
    line = one_line(result.stderr)
    assert f"{service.url}/somewhere" in line and "MODELPREP_URL" in line


def test_validation_errors_name_the_field_and_suggest_the_closest_value(
    service: ServiceProcess, root: Path
) -> None:
    result = modelprep("submit", str(root / "llama"), "-e", "gguf:q4km", url=service.url)
    assert result.returncode == 2
    line = one_line(result.stderr)
    assert "exports[0].type" in line and "did you mean 'Q4_K_M'?" in line
    assert "literal[" not in line and "body." not in line
    unknown = modelprep("submit", str(root / "llama"), "-e", "safetensor", url=service.url)
    assert "did you mean 'safetensors'?" in one_line(unknown.stderr)


def test_version_and_help_for_every_option() -> None:
    from service.cli.commands import build_parser

    version = subprocess.run([sys.executable, "-m", "service.cli", "--version"],
                             capture_output=True, text=True, timeout=60, check=False)
    assert version.returncode == 0 and version.stdout.startswith("modelprep "), version
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    assert isinstance(commands, dict)
    undocumented = []
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            text = action.help or ""
            optional = bool(action.option_strings) and not action.required
            takes_value = action.nargs != 0
            if not text or (optional and takes_value and "default" not in text):
                undocumented.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert not undocumented, f"options without help or default: {undocumented}"
    url_help = subprocess.run([sys.executable, "-m", "service.cli", "jobs", "--help"],
                              capture_output=True, text=True, timeout=60, check=False).stdout
    assert "MODELPREP_URL" in url_help and "MODELPREP_API_KEY" in url_help


def test_the_same_spellings_are_accepted_everywhere(service: ServiceProcess, root: Path) -> None:
    """``safetensors:bf16`` as GGUF takes ``bf16``; ``gguf:q4_k_m`` as the schema's Q4_K_M."""
    short = modelprep("submit", str(root / "llama"), "-e", "safetensors:bf16", "--wait", "-q",
                      url=service.url)
    assert short.returncode == 0, short.stderr
    job = json.loads(modelprep("status", short.stdout.strip(), url=service.url).stdout)
    assert job["request"]["exports"][0]["dtype"] == "bfloat16"
    # refused for its source, after the export spec was accepted as it is spelled
    lower = modelprep("submit", "file:///elsewhere/model", "-e", "gguf:q4_k_m", url=service.url)
    assert lower.returncode == 2 and "source_not_allowed" in one_line(lower.stderr)
