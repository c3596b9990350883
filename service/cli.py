"""``modelprep`` command line: run the service or a worker, print its OpenAPI document, make
API keys, and talk to a running service as a client (``service.client_cli``)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.api.app import create_app
    from service.api.auth import check_binding
    from service.config import Settings
    from service.errors import ConfigurationError
    from service.logs import configure_logging

    settings = Settings()
    configure_logging(settings)
    try:
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
    from service.config import Settings
    from service.errors import ConfigurationError
    from service.jobs.worker import run_worker
    from service.logs import configure_logging

    settings = Settings()
    configure_logging(settings)
    try:
        run_worker(settings, health_file=args.health_file)
    except ConfigurationError as exc:
        print(f"modelprep worker: {exc.message}", file=sys.stderr)
        return 2
    return 0


def _openapi(args: argparse.Namespace) -> int:
    from service.api.openapi import openapi_document

    json.dump(openapi_document(), sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modelprep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the HTTP service (settings from MODELPREP_*)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=_serve)

    worker = sub.add_parser(
        "worker", help="run queued jobs from PostgreSQL (MODELPREP_DATABASE_URL) until SIGTERM"
    )
    worker.add_argument(
        "--health-file", type=Path, default=None,
        help="touch this file on every heartbeat (a container health check reads its age)",
    )
    worker.set_defaults(func=_worker)

    openapi = sub.add_parser("openapi", help="print the OpenAPI document")
    openapi.set_defaults(func=_openapi)

    from service.client_cli import add_client_commands

    add_client_commands(sub)  # keygen, submit, status, wait, cancel, download, jobs
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "client_command", False):
        from service.client_cli import run_client_command

        return run_client_command(args.func, args)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
