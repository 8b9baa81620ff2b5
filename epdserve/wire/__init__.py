"""What crosses a socket between stages: the message dataclasses, their validation, and the ZeroMQ transport."""
