"""alembic revisions of the job store (a package so that they ship with modelprep)."""
