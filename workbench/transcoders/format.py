"""Our transcoder-set format: ``transcoders.json`` and ``transcoders.safetensors`` in one folder; writing it.

The file keeps circuit-tracer's layout per layer (``W_enc.{l} [F, D]``, ``W_dec.{l} [F, O, D]``, ``b_enc.{l}``,
``threshold.{l}``, ``b_dec [L, D]``) and ``W_skip.{l}`` in the orientation applied as ``x @ W_skip.{l}`` (the
transpose of the in-memory one), as version 1 wrote it; the conversion from and to the in-memory layout
(``workbench.transcoders.layout``) happens here and in ``files._from_ours`` only. Saves go through
``workbench.safe_files.save_files``: temporaries renamed into place, so a failed save leaves the old set loadable.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence, Union

from safetensors.torch import save_file
from torch import Tensor

from workbench.safe_files import save_files

OUR_CONFIG, OUR_WEIGHTS = "transcoders.json", "transcoders.safetensors"
FORMAT_NAME = "workbench-transcoders"


class SavedTranscoders(Protocol):
    """What a save reads of a transcoder set (a ``wb.TranscoderSet``): its hooks, ``scan`` and circuit-tracer's
    view of its weights."""

    n_layers: int
    feature_input_hook: str
    feature_output_hook: str
    scan: Any
    W_enc: Sequence[Tensor]
    b_enc: Sequence[Tensor]
    threshold: Sequence[Optional[Tensor]]
    W_dec: Sequence[Tensor]
    b_dec: Tensor
    W_skip: Optional[Sequence[Tensor]]


def save_transcoders(transcoders: SavedTranscoders, path: Union[str, Path]) -> Path:
    """Writes ``transcoders`` (a ``wb.TranscoderSet``) into folder ``path`` in our format (``TranscoderSet.save``).
    Returns ``path``.

    Example:
        >>> import tempfile
        >>> tc = wb.load_transcoders("tests/fixtures/attribution/plt")
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     sorted(p.name for p in save_transcoders(tc, folder).iterdir())
        ['transcoders.json', 'transcoders.safetensors']
    """
    tensors = {"b_dec": transcoders.b_dec}
    for layer in range(transcoders.n_layers):
        tensors[f"W_enc.{layer}"], tensors[f"b_enc.{layer}"] = transcoders.W_enc[layer], transcoders.b_enc[layer]
        tensors[f"W_dec.{layer}"] = transcoders.W_dec[layer]
        if transcoders.threshold[layer] is not None:
            tensors[f"threshold.{layer}"] = transcoders.threshold[layer]
        if transcoders.W_skip is not None:
            tensors[f"W_skip.{layer}"] = transcoders.W_skip[layer].T   # the file's orientation: x @ W_skip.{l}
    tensors = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    scan = transcoders.scan
    config = {"format": FORMAT_NAME, "version": 1, "n_layers": transcoders.n_layers,
              "feature_input_hook": transcoders.feature_input_hook,
              "feature_output_hook": transcoders.feature_output_hook,
              "scan": scan if isinstance(scan, (str, list, type(None))) else str(scan)}
    text = json.dumps(config, indent=1) + "\n"
    return save_files(path, {OUR_WEIGHTS: lambda target: save_file(tensors, str(target)),
                             OUR_CONFIG: lambda target: target.write_text(text)}, what="transcoder folder")
