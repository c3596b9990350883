"""Structured logging: one JSON object per line, carrying the job id inside job processes.

Secrets never reach a log record: settings hold them as ``SecretStr`` and job specs are logged
only in their stored (secret-free) form.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

from service.config import Settings

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
_DROPPED = {"color_message"}  # uvicorn's copy of the message with terminal colour codes
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

QUIET_LOGGERS = {"alembic.runtime.plugins": logging.WARNING}
"""Loggers whose INFO lines say nothing an operator needs (alembic lists the plugins it
loads on every start); their warnings still pass."""


class _AlembicPreamble(logging.Filter):
    """Drops alembic's two lines about the dialect before each migration run; the lines
    naming each migration applied stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Context impl ", "Will assume "))

request_id: ContextVar[str | None] = ContextVar("modelprep_request_id", default=None)
"""The id of the HTTP request being handled (set by the API's access middleware), so every
line logged while serving it carries ``request_id``."""


class JsonFormatter(logging.Formatter):
    def __init__(self, job_id: str | None = None) -> None:
        super().__init__()
        self.job_id = job_id

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _ANSI.sub("", record.getMessage()),
        }
        if self.job_id:
            entry["job_id"] = self.job_id
        current_request = request_id.get()
        if current_request:
            entry["request_id"] = current_request
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in _DROPPED and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(settings: Settings, job_id: str | None = None) -> None:
    """Every log line to stderr, one JSON object each (``MODELPREP_LOG_JSON``, default) or
    plain text, from ``MODELPREP_LOG_LEVEL`` up; chatter of other libraries quietened."""
    handler = logging.StreamHandler(sys.stderr)
    if settings.log_json:
        handler.setFormatter(JsonFormatter(job_id))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(settings.log_level.upper())
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level if root.level > logging.DEBUG else logging.NOTSET)
    migration = logging.getLogger("alembic.runtime.migration")
    if not any(isinstance(f, _AlembicPreamble) for f in migration.filters):
        migration.addFilter(_AlembicPreamble())
