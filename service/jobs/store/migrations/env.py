"""alembic environment: migrations always run on a connection handed over by ``upgrade()``.

``alembic`` on the command line (for ``revision --autogenerate``) passes ``-x url=...``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlalchemy.engine import Connection

from service.jobs.store.schema import metadata

config = context.config
connection = config.attributes.get("connection")


def _run(conn: Connection) -> None:
    context.configure(
        connection=conn,
        target_metadata=metadata,
        # only our table: procrastinate's tables are installed by a revision, not modelled here
        include_name=lambda name, type_, _parent: type_ != "table" or name in metadata.tables,
        render_as_batch=True,  # SQLite alters tables by copy
    )
    with context.begin_transaction():
        context.run_migrations()


if connection is not None:
    _run(connection)
else:
    url = context.get_x_argument(as_dictionary=True).get("url")
    if not url:
        raise SystemExit(
            "run migrations through service.jobs.store.migrations.upgrade(), or -x url="
        )
    with create_engine(url).begin() as own:
        _run(own)
