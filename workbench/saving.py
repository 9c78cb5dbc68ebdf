"""Writing a ``Decoder`` in our own format: config.json + model.safetensors (+ tokenizer files).

This module sits beside the model, not among the loaders, so ``Decoder.save`` needs nothing from
``workbench.loading`` (which imports the model): the dependency runs one way. The reader is
``workbench.loading.native``; the file names and the format tag are shared from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Union

from safetensors.torch import save_file

from workbench.host import DecoderHost

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FORMAT_TAG = "workbench"


def save_native(model: DecoderHost, directory: Union[str, Path]) -> Path:
    """Writes the model so ``wb.load_model(directory)`` rebuilds it exactly.

    Tied parameters (one Parameter under two names) are written once. Nothing is pickled.

    Example:
        >>> import shutil, tempfile
        >>> directory = save_native(model, Path(tempfile.mkdtemp()) / "my-model")
        >>> sorted(path.name for path in directory.iterdir())
        ['config.json', 'model.safetensors', 'special_tokens.json', 'tokenizer.json']
        >>> torch.equal(wb.load_model(directory)(tokens), model(tokens))   # the same model again
        True
        >>> shutil.rmtree(directory.parent)
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = {"format": FORMAT_TAG, **model.cfg.to_dict()}  # the architecture and the options it keeps
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    state = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied: the second name of one Parameter
            continue
        seen.add(id(tensor))
        state[name] = tensor.detach().cpu().contiguous()
    save_file(state, str(directory / WEIGHTS_FILE))
    if model.tokenizer is not None:
        model.tokenizer.save(directory)
    return directory
