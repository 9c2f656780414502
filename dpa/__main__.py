"""``python -m dpa``: the same as the ``dpa`` command."""

from .cli import main

raise SystemExit(main())
