"""dsv4serve: an async, actor-based serving microkernel for DeepSeek-V4."""

__version__ = "0.1.0"
