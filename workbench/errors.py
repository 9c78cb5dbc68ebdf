"""Exceptions the workbench raises for bad input.

Each subclasses a builtin (``ValueError``/``FileNotFoundError``) so callers that catch the
builtin keep working, while tests and the dashboard can catch the specific kind.
"""


class ConfigError(ValueError):
    """A ``ModelConfig`` field holds a value the model cannot honour; the message names the field.

    Example:
        >>> wb.ModelConfig(n_layers=1, d_model=8, n_heads=2, d_vocab=5, n_ctx=4, normalization="BN")
        Traceback (most recent call last):
        workbench.errors.ConfigError: ModelConfig.normalization must be one of ('LN', 'RMS'), got 'BN'
    """


class InputError(ValueError):
    """Tokens or text handed to a model are unusable (out of range, too long, empty, wrong dtype).

    Example:
        >>> try:
        ...     model(torch.zeros(1, 300, dtype=torch.long))
        ... except ValueError as error:   # caught as the builtin too
        ...     print(type(error).__name__, error)
        InputError sequence of 300 tokens is longer than the model's context (n_ctx=256)
    """


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, mis-shaped or of an unknown architecture.

    The message names the file and the tensor or config field at fault.

    Example:
        >>> try:
        ...     wb.load_model("runs/no-such-model")
        ... except CheckpointError as error:
        ...     print(error)
        runs/no-such-model: no such file or directory, and not a registered model name (registered: [...])
    """


class CacheTooLargeError(InputError):
    """An activation cache would not fit where it was asked to go (memory of the target device, or
    the disk of ``cache_dir``); the message gives the bytes requested and available and what to change.

    Example:
        >>> issubclass(CacheTooLargeError, InputError)   # an ``except InputError`` catches it too
        True
    """
