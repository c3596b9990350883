"""``python -m service.cli``: the ``modelprep`` command without its installed script."""

from service.cli import main

raise SystemExit(main())
