"""``modelprep`` command line: run the service or a worker, print its OpenAPI document, make
API keys, and talk to a running service as a client (``service.cli.client_commands``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.api.app import create_app
    from service.api.auth import check_binding
    from service.config import load_settings
    from service.errors import ConfigurationError
    from service.logs import configure_logging

    try:
        settings = load_settings()
        configure_logging(settings)
        app = create_app(settings)
        check_binding(app.state.keyring, args.host)
    except ConfigurationError as exc:
        print(f"modelprep serve: {exc.message}", file=sys.stderr)
        return 2
    uvicorn.run(
        app, host=args.host, port=args.port, log_config=None, access_log=False,
        timeout_keep_alive=settings.http_keep_alive_seconds,
    )
    return 0


def _worker(args: argparse.Namespace) -> int:
    from service.api.schemas import job_json
    from service.config import load_settings
    from service.errors import ConfigurationError
    from service.jobs.worker import run_worker
    from service.logs import configure_logging

    try:
        settings = load_settings()
        configure_logging(settings)
        run_worker(settings, health_file=args.health_file, render=job_json)
    except ConfigurationError as exc:
        print(f"modelprep worker: {exc.message}", file=sys.stderr)
        return 2
    return 0


WORKER_HEALTH_FILE = Path("/tmp/modelprep-worker.alive")


def _healthcheck(args: argparse.Namespace) -> int:
    """Container probe for either role, so one image-level HEALTHCHECK serves both: a worker
    started with ``--health-file`` is healthy while it touches that file (every heartbeat);
    anything else is an API, healthy when ``/readyz`` answers 200."""
    import time
    import urllib.error
    import urllib.request

    if args.file.exists():
        age = time.time() - args.file.stat().st_mtime
        if age > args.max_age:
            print(f"worker heartbeat file {args.file} is {age:.0f}s old", file=sys.stderr)
            return 1
        return 0
    try:
        with urllib.request.urlopen(args.url, timeout=args.timeout) as response:
            return 0 if response.status == 200 else 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"{args.url}: {exc}", file=sys.stderr)
        return 1


def _openapi(args: argparse.Namespace) -> int:
    from service.api.openapi import openapi_document

    json.dump(openapi_document(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


def _demo_model(args: argparse.Namespace) -> int:
    from service.cli.demo import write_demo_model

    for path in write_demo_model(args.directory):
        print(path)
    return 0


def _reference(args: argparse.Namespace) -> int:
    if args.page == "settings":
        from service.config import settings_reference

        sys.stdout.write(settings_reference())
    else:
        from service.api.problems import markdown

        sys.stdout.write(markdown())
    return 0


def package_version() -> str:
    """The installed modelprep's version (``unknown`` when run from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelprep")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``modelprep`` parser: the server commands here, the client commands from
    ``client_commands``; each subcommand sets ``func``."""
    parser = argparse.ArgumentParser(prog="modelprep", description=__doc__)
    parser.add_argument("--version", action="version", version=f"modelprep {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service (settings from MODELPREP_*)")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default: 127.0.0.1; any other address "
                       "needs MODELPREP_API_KEYS)")
    serve.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    serve.set_defaults(func=_serve)

    worker = sub.add_parser(
        "worker", help="run queued jobs from PostgreSQL (MODELPREP_DATABASE_URL) until SIGTERM"
    )
    worker.add_argument(
        "--health-file", type=Path, default=None,
        help="touch this file on every heartbeat (a container health check reads its age; "
        "default: none)",
    )
    worker.set_defaults(func=_worker)

    health = sub.add_parser(
        "healthcheck",
        help="exit 0 when this container's worker (heartbeat file) or API (/readyz) is healthy",
    )
    health.add_argument("--file", type=Path, default=WORKER_HEALTH_FILE,
                        help=f"a worker's heartbeat file (default: {WORKER_HEALTH_FILE})")
    health.add_argument("--max-age", type=float, default=30.0,
                        help="seconds the heartbeat file may be old (default: 30)")
    health.add_argument("--url", default="http://127.0.0.1:8000/readyz",
                        help="the API's readiness URL (default: http://127.0.0.1:8000/readyz)")
    health.add_argument("--timeout", type=float, default=3.0,
                        help="seconds to wait for /readyz (default: 3)")
    health.set_defaults(func=_healthcheck)

    openapi = sub.add_parser("openapi", help="print the OpenAPI document")
    openapi.set_defaults(func=_openapi)

    demo = sub.add_parser(
        "demo-model", help="write a real tiny checkpoint (a 2-layer Llama made by transformers, "
        "about 0.3 MB) to try the service on; nothing is downloaded",
    )
    demo.add_argument("directory", type=Path, help="where to write it (created)")
    demo.set_defaults(func=_demo_model)

    reference = sub.add_parser(
        "reference", help="print a generated reference page: settings (docs/settings.md) or "
        "errors (docs/errors.md)",
    )
    reference.add_argument("page", choices=["settings", "errors"], help="which page")
    reference.set_defaults(func=_reference)

    from service.cli.client_commands import add_client_commands

    add_client_commands(sub)  # keygen, submit, status, wait, cancel, download, jobs
    return parser
