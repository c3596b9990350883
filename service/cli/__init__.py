"""The ``modelprep`` entry point (``service.cli:main``).

- ``commands``: the parser, and the server-side commands: ``serve``, ``worker``,
  ``healthcheck``, ``openapi``, ``reference``, ``demo-model``.
- ``client_commands``: the commands that talk to a running service through
  :class:`service.client.ModelprepClient` (``submit``, ``status``, ``wait``, ``cancel``,
  ``delete``, ``download``, ``jobs``, ``keygen``), their progress view and exit codes.
- ``demo``: the tiny real checkpoint ``demo-model`` writes.
"""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run one ``modelprep`` command and return its exit code."""
    from service.cli.commands import build_parser

    args = build_parser().parse_args(argv)
    if getattr(args, "client_command", False):
        import signal

        from service.cli.client_commands import run_client_command

        # `modelprep jobs | head`: a closed pipe ends a client command quietly, as it does
        # any Unix filter (the servers keep Python's default: a closed socket is an error).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        return run_client_command(args.func, args)
    code: int = args.func(args)
    return code
