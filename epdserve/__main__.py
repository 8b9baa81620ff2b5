"""``python -m epdserve ...`` is the ``epdserve`` command."""
import sys

from epdserve.entry.cli import main

if __name__ == "__main__":
    sys.exit(main())
