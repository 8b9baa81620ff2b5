"""epdserve: encode / prefill / decode disaggregated serving for vision-language models."""

__version__ = "0.1.0"
