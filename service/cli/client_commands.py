"""The client subcommands of ``modelprep`` (submit, status, wait, cancel, download, jobs) and
``keygen``; registered on the parser by ``service.cli.commands``.

The server and key come from ``--url`` / ``--api-key`` or ``MODELPREP_URL`` /
``MODELPREP_API_KEY``, resolved when a command runs (never at import). Machine-readable output
(job ids, JSON) goes to stdout, progress and messages to stderr.

Exit codes say what happened:

    0  done (the job succeeded, or the request was served)
    1  the job failed
    2  usage error, or the service refused the request as invalid (4xx)
    3  the job was cancelled
    4  service unreachable, server error (5xx), or a corrupt download
    5  authentication or permission refused (401, 403)
    6  no such job (404; also another tenant's job), or its files were deleted (410)
    7  a limit was reached (429); retry later

Every error is one line on stderr; one about reaching the service names the URL tried and how
to change it (``--url`` or ``MODELPREP_URL``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from service.client import JobEvent, ModelprepClient, problem_code
from service.errors import (
    ApiError,
    ArtifactCorrupt,
    ArtifactsDeleted,
    ClientError,
    ServiceUnreachable,
)

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_CANCELLED = 3
EXIT_UNAVAILABLE = 4
EXIT_AUTH = 5
EXIT_NOT_FOUND = 6
EXIT_LIMITED = 7

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 30.0

SHORTHAND_OPTION = {"safetensors": "dtype", "gguf": "type", "nnef": "compression"}
"""What the bare option of ``--export FORMAT:OPTION`` sets, per format."""


def parse_export(text: str) -> dict[str, Any]:
    """An export spec from ``--export``: JSON (``{"format": ...}``), ``FORMAT``,
    ``FORMAT:OPTION`` (e.g. ``gguf:q8_0``) or ``FORMAT:key=value,key=value``."""
    text = text.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON export spec: {exc}") from exc
        if not isinstance(spec, dict) or "format" not in spec:
            raise argparse.ArgumentTypeError('a JSON export spec needs a "format"')
        return spec
    fmt, _, options = text.partition(":")
    if not fmt:
        raise argparse.ArgumentTypeError(f"no format in export {text!r}")
    spec = {"format": fmt}
    if not options:
        return spec
    if "=" not in options:
        if fmt not in SHORTHAND_OPTION:
            raise argparse.ArgumentTypeError(
                f"{fmt}: use {fmt}:key=value (shorthand known for {sorted(SHORTHAND_OPTION)})"
            )
        spec[SHORTHAND_OPTION[fmt]] = options
        return spec
    for pair in options.split(","):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"expected key=value in {pair!r}")
        spec[key.strip()] = value.strip()
    return spec


def source_uri(source: str) -> str:
    """A URI as given, or ``file://`` + the absolute path of a local path."""
    if "://" in source:
        return source
    return Path(source).expanduser().resolve().as_uri()


# --- progress display ----------------------------------------------------------------------


def _human(n: float, unit: str) -> str:
    if unit != "bytes":
        return f"{int(n)} {unit}"
    for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or suffix == "TiB":
            return f"{n:.0f} {suffix}" if suffix == "B" else f"{n:.1f} {suffix}"
        n /= 1024
    return f"{n:.1f} TiB"


class ProgressView:
    """Renders job events: a bar per phase redrawn in place on a terminal, one plain line per
    status or phase change otherwise (logs, CI)."""

    WIDTH = 30

    def __init__(self, stream: TextIO, tty: bool | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self._phase: str | None = None

    def __call__(self, event: JobEvent) -> None:
        data = event.data
        phase, status = data["phase"], data["status"]
        if self.tty:
            if self._phase is not None and phase != self._phase:
                self.stream.write("\n")
            self.stream.write("\r\x1b[2K" + self._bar(data))
            if event.terminal:
                self.stream.write(f"\n{status}\n")
        elif event.kind in ("status", "phase"):
            self.stream.write(f"{data['id']} {status} {phase} {self._amount(data)}\n")
        self._phase = phase
        self.stream.flush()

    def _amount(self, data: dict[str, Any]) -> str:
        progress = data["progress"]
        done, total, unit = progress["done"], progress["total"], progress["unit"]
        if total:
            return f"{_human(done, unit)}/{_human(total, unit)}"
        return _human(done, unit)

    def _bar(self, data: dict[str, Any]) -> str:
        progress = data["progress"]
        total = progress["total"]
        if total:
            filled = min(self.WIDTH, int(self.WIDTH * progress["done"] / total))
            bar = "#" * filled + "-" * (self.WIDTH - filled)
            percent = f"{100 * progress['done'] / total:5.1f}%"
        else:
            bar, percent = "." * self.WIDTH, "   ? "
        return f"{data['phase']:<9} [{bar}] {percent} {self._amount(data)}"


# --- commands ------------------------------------------------------------------------------


def _client(args: argparse.Namespace) -> ModelprepClient:
    """The client for ``--url``/``--api-key``, else ``MODELPREP_URL``/``MODELPREP_API_KEY``."""
    url = args.url or os.environ.get("MODELPREP_URL") or DEFAULT_URL
    key = args.api_key or os.environ.get("MODELPREP_API_KEY") or None
    return ModelprepClient(url, key, timeout=args.timeout)


def _finish(job: dict[str, Any]) -> int:
    """Report a finished job on stderr; its exit code."""
    status = job["status"]
    if status == "succeeded":
        return EXIT_OK
    error = job.get("error") or {}
    print(f"job {job['id']} {status}: {error.get('type')}: {error.get('message')}",
          file=sys.stderr)
    return EXIT_CANCELLED if status == "cancelled" else EXIT_JOB_FAILED


def _wait(client: ModelprepClient, job_id: str, quiet: bool) -> int:
    view: Callable[[JobEvent], None] | None = None if quiet else ProgressView(sys.stderr)
    return _finish(client.wait(job_id, view))


def cmd_submit(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"source": source_uri(args.source), "exports": args.export}
    for key in ("revision", "sha256", "max_memory"):
        if getattr(args, key):
            body[key] = getattr(args, key)
    if args.no_verify:
        body["verify"] = False
    if args.hf_token_file:
        body["hf_token"] = Path(args.hf_token_file).read_text().strip()
    if args.callback:
        body["callback"] = {"url": args.callback}
    with _client(args) as client:
        job = client.submit(body)
        print(job["id"])
        sys.stdout.flush()
        return _wait(client, job["id"], args.quiet) if args.wait else EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.job(args.job), indent=2))
    return EXIT_OK


def cmd_wait(args: argparse.Namespace) -> int:
    with _client(args) as client:
        return _wait(client, args.job, args.quiet)


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        try:
            job = client.cancel(args.job)
        except ApiError as exc:
            if exc.http_status != 409:
                raise
            print(f"modelprep: job {args.job} has already ended: nothing to cancel (its files "
                  f"stay; `modelprep delete {args.job}` removes them)", file=sys.stderr)
            return EXIT_USAGE
        print(f"{job['id']} {job['status']}"
              + (" (cancel requested)" if job["cancel_requested"] else ""))
    return EXIT_OK


def cmd_delete(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.delete(args.job)
        if job.get("deleted_at"):
            freed = job["metrics"].get("artifact_bytes_freed", 0)
            print(f"{job['id']} {job['status']}, files deleted ({_human(freed, 'bytes')} freed)")
        else:
            print(f"{job['id']} {job['status']}"
                  + (" (cancel requested)" if job["cancel_requested"] else ""))
    return EXIT_OK


def cmd_download(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job = client.job(args.job)
        if job.get("deleted_at"):
            raise ArtifactsDeleted(
                f"job {job['id']} succeeded, but its files were deleted at {job['deleted_at']}:"
                " nothing to download (submit it again to remake them)"
            )
        if job["status"] != "succeeded":
            print(f"job {job['id']} is {job['status']}: no artifacts to download",
                  file=sys.stderr)
            return _finish(job) if job["status"] in ("failed", "cancelled") else EXIT_USAGE
        out = Path(args.output) if args.output else Path(job["id"])
        shown: set[str] = set()

        def progress(path: str, done: int, total: int) -> None:
            if done >= total and path not in shown:
                shown.add(path)
                print(f"{path} {_human(total, 'bytes')} ok", file=sys.stderr)

        for path in client.download(job, out, on_progress=None if args.quiet else progress):
            print(path)
    return EXIT_OK


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client(args) as client:
        jobs = client.jobs(status=args.status, page_size=min(args.limit, 500))
        for job in itertools.islice(jobs, args.limit):
            if args.json:
                print(json.dumps(job))
            else:
                status = "deleted" if job.get("deleted_at") else job["status"]
                print(f"{job['id']}  {status:<9} {job['phase']:<9} "
                      f"{job['created_at'][:19]}  {job['request'].get('source', '')}")
    return EXIT_OK


def cmd_keygen(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from service.api.auth import keygen_line

    try:
        key, entry = keygen_line(args.tenant, args.admin)
    except ValidationError:
        print(f"modelprep: invalid tenant {args.tenant!r}: use 1-64 of A-Z a-z 0-9 . _ -",
              file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        print(json.dumps({"key": key, "entry": json.loads(entry)}))
        return EXIT_OK
    print(f"key: {key}")
    print("Give the key to the tenant now: the service stores only its sha256 and cannot show "
          "it again.", file=sys.stderr)
    print(f"config: {entry}")
    print(f"e.g. MODELPREP_API_KEYS='[{entry}]' (or add the entry to MODELPREP_API_KEYS_FILE)",
          file=sys.stderr)
    return EXIT_OK


def exit_code_for(exc: ClientError) -> int:
    """The documented exit code of a client error."""
    if isinstance(exc, ApiError):
        status = exc.http_status
        if status in (401, 403):
            return EXIT_AUTH
        if status == 404:
            # a route this server does not have (a wrong --url) is not a missing job
            code = problem_code(exc.problem)
            return EXIT_UNAVAILABLE if code in (None, "not_found") else EXIT_NOT_FOUND
        if status == 410:
            return EXIT_NOT_FOUND
        if status == 429:
            return EXIT_LIMITED
        return EXIT_USAGE if 400 <= status < 500 else EXIT_UNAVAILABLE
    if isinstance(exc, ServiceUnreachable | ArtifactCorrupt):
        return EXIT_UNAVAILABLE
    if isinstance(exc, ArtifactsDeleted):
        return EXIT_NOT_FOUND
    return EXIT_USAGE


def run_client_command(func: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """Run a client command, turning its typed errors into a message and an exit code."""
    try:
        return func(args)
    except ClientError as exc:
        print(f"modelprep: {exc.message}", file=sys.stderr)
        return exit_code_for(exc)
    except OSError as exc:  # a local file (token file, output directory)
        print(f"modelprep: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


def add_client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register keygen and the client subcommands on ``modelprep``'s subparsers."""
    conn = argparse.ArgumentParser(add_help=False)
    conn.add_argument(
        "--url", help=f"the service's address, http://HOST:PORT (a bare HOST:PORT and a "
        f"trailing /v1 are accepted; default: $MODELPREP_URL, else {DEFAULT_URL})",
    )
    conn.add_argument(
        "--api-key", help="the API key to send as Authorization: Bearer (default: "
        "$MODELPREP_API_KEY, else none: a service without keys on loopback)",
    )
    conn.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                      help=f"seconds to wait for each request (default: {DEFAULT_TIMEOUT:g})")
    quiet = argparse.ArgumentParser(add_help=False)
    quiet.add_argument("-q", "--quiet", action="store_true",
                       help="no progress on stderr (default: progress shown)")
    job = argparse.ArgumentParser(add_help=False)
    job.add_argument("job", help="the job's id, as submit prints it")

    p = sub.add_parser("submit", parents=[conn, quiet], help="submit a job; print its id")
    p.add_argument("source", help="file:///..., hf://org/repo, http(s)://..., or a local path "
                   "(sent as file:// + its absolute path)")
    p.add_argument("--export", "-e", action="append", type=parse_export, required=True,
                   help="FORMAT[:OPTION] (safetensors:bf16, gguf:Q4_K_M, nnef:q4_0), "
                        "FORMAT:key=value,... or a JSON spec; repeatable (required)")
    p.add_argument("--revision", help="hf:// branch, tag or commit (default: main)")
    p.add_argument("--sha256", help="expected sha256 of an http(s):// weights file "
                   "(default: not checked)")
    p.add_argument("--max-memory", help="CPU budget for the weights, e.g. 1GiB (default: the "
                   "service's MODELPREP_DEFAULT_MAX_MEMORY)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip numerical verification (default: verify)")
    p.add_argument("--hf-token-file", help="file holding a hub token for this job (default: "
                   "the service's MODELPREP_HF_TOKEN)")
    p.add_argument("--callback", metavar="URL",
                   help="POST the job's JSON there, signed, when it ends (default: none; "
                   "docs/api.md: callbacks)")
    p.add_argument("--wait", action="store_true",
                   help="follow the job until it ends (default: print the id and return)")
    p.set_defaults(func=cmd_submit, client_command=True)

    p = sub.add_parser("status", parents=[conn, job], help="print a job's JSON")
    p.set_defaults(func=cmd_status, client_command=True)

    p = sub.add_parser("wait", parents=[conn, quiet, job],
                       help="follow a job with live progress; exit 0 if it succeeded")
    p.set_defaults(func=cmd_wait, client_command=True)

    p = sub.add_parser("cancel", parents=[conn, job],
                       help="cancel a queued or running job (a finished job is refused and "
                       "keeps its files: see delete)")
    p.set_defaults(func=cmd_cancel, client_command=True)

    p = sub.add_parser("delete", parents=[conn, job],
                       help="remove a finished job's files (the job stays, marked deleted); "
                       "an unfinished job is cancelled")
    p.set_defaults(func=cmd_delete, client_command=True)

    p = sub.add_parser("download", parents=[conn, quiet, job],
                       help="download a job's artifacts (resumable, sha256-checked)")
    p.add_argument("-o", "--output", help="directory (default: ./JOB_ID)")
    p.set_defaults(func=cmd_download, client_command=True)

    p = sub.add_parser("jobs", parents=[conn], help="list jobs, newest first")
    p.add_argument("--status", choices=["queued", "running", "succeeded", "failed", "cancelled"],
                   help="only jobs in this status (default: all)")
    p.add_argument("--limit", type=int, default=20, help="at most this many (default: 20)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line (default: a table; deleted jobs say deleted)")
    p.set_defaults(func=cmd_jobs, client_command=True)

    p = sub.add_parser("keygen", help="make an API key; print it and its configuration entry")
    p.add_argument("--tenant", required=True, help="the tenant the key belongs to (required)")
    p.add_argument("--admin", action="store_true",
                   help="the key sees every tenant's jobs (default: its tenant's only)")
    p.add_argument("--json", action="store_true",
                   help='print {"key", "entry"} as JSON (default: readable lines)')
    p.set_defaults(func=cmd_keygen, client_command=True)
