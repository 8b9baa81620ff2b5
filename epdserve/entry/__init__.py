"""Entry points: the ``epdserve`` command line and ``epdserve launch``."""
