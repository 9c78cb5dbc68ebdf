"""The one check of a ``device=`` argument, made before a loader reads any file (``wb.load_model``, ``wb.load_sae``,
``wb.load_transcoders``); ``workbench.loading.placement`` checks a ``device_map``'s devices itself.
"""

from __future__ import annotations

from typing import Union

import torch

from workbench.errors import ConfigError


def check_device(device: Union[str, torch.device]) -> torch.device:
    """``device`` parsed, or a ``ConfigError`` naming it when it is not a device or this machine has none such (torch's
    own "Torch not compiled with CUDA enabled" would come from deep inside a load, after the files were read).

    Example:
        >>> check_device("cpu")
        device(type='cpu')
        >>> check_device("gpu")
        Traceback (most recent call last):
        workbench.errors.ConfigError: device='gpu' is not a device (e.g. 'cpu', 'cuda', 'cuda:1', 'mps')
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device={device!r} is not a device (e.g. 'cpu', 'cuda', 'cuda:1', 'mps')") from error
    if parsed.type == "cuda" and (parsed.index or 0) >= torch.cuda.device_count():
        build = "a CUDA build" if torch.version.cuda else "a CPU-only build"
        raise ConfigError(f"device={device!r}, but this machine has {torch.cuda.device_count()} CUDA device(s) "
                          f"(torch {torch.__version__} is {build})")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device!r}, but MPS is not available on this machine")
    return parsed
