"""The oscar-hf version: read by pyproject, keyed into the rotations made on demand."""

__version__ = "0.1.0"
