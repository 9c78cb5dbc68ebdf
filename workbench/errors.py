"""Exceptions the workbench raises for bad input.

Each subclasses a builtin (``ValueError``/``FileNotFoundError``) so callers that catch the
builtin keep working, while tests and the dashboard can catch the specific kind.
"""


class ConfigError(ValueError):
    """A ``ModelConfig`` field holds a value the model cannot honour; the message names the field."""


class InputError(ValueError):
    """Tokens or text handed to a model are unusable (out of range, too long, empty, wrong dtype)."""


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, mis-shaped or of an unknown architecture.

    The message names the file and the tensor or config field at fault.
    """


class CacheTooLargeError(InputError):
    """An activation cache would not fit where it was asked to go (memory of the target device, or
    the disk of ``cache_dir``); the message gives the bytes requested and available and what to change."""
