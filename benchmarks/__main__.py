"""``python -m epdserve.bench ...``: the same as ``epdserve bench ...``."""

from .cli import main

raise SystemExit(main())
