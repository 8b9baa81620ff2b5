"""epdserve.bench: the end-to-end serving benchmark behind ``epdserve bench`` (see README.md in this folder)."""
