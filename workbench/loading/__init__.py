"""Turning checkpoints into ``Decoder``s: registered names, HF directories, GGUF files, our own format.

``load_model`` decides what ``source`` is and hands it to one loader; each loader builds the
config, reads and checks every tensor, and only then returns a model, so a failure never
leaves a half-loaded model behind. Nothing is fetched from a hub and nothing is unpickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import pandas as pd
import torch

from workbench.errors import CheckpointError
from workbench.loading.gguf_loader import GGUF_MODELS, load_gguf
from workbench.loading.hf import FAMILIES, is_hf_directory, load_hf_directory, read_config
from workbench.loading.native import FORMAT_TAG, load_native
from workbench.loading.registry import REGISTRY, default_model_name, list_models

__all__ = ["load_model", "list_models", "default_model_name", "supported_architectures", "CheckpointNotFoundError"]


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """``source`` is neither a registered name nor an existing path (catchable as either base)."""


def load_model(source: Union[str, Path], attn_impl: str = "sdpa", dtype: Optional[torch.dtype] = None,
               device: str = "cpu", progress: Optional[bool] = None, *, fold_ln: bool = False,
               center_writing_weights: bool = False, center_unembed: bool = False, fold_value_biases: bool = False):
    """Loads a model from a registered name, an HF directory, a .gguf file or a saved directory.

    By default the weights are as in the checkpoint (logits equal `transformers`'). The four
    processing options apply TransformerLens's weight processing after loading
    (``workbench.processing.process_weights``; recorded in ``cfg.weight_processing``): all four on
    is what ``HookedTransformer.from_pretrained`` gave. ``center_writing_weights`` needs a pre-norm
    LayerNorm model (GPT-2) and ``fold_ln`` a pre-norm one: otherwise ``ConfigError``.

    Args:
        source: a name from ``wb.list_models()``, an HF-format directory (config.json +
            *.safetensors), a ``.gguf`` file, or a directory written by ``model.save()``.
        attn_impl: "eager", "sdpa" or "flash".
        dtype: torch.float32, torch.bfloat16 or torch.float16; None: the checkpoint's own (an HF or
            saved directory's weights are read straight into it; a GGUF file's dequantised blocks
            become float32).
        device: where the weights go.
        progress: progress bar while reading tensors (None: only for checkpoints over 64 MiB).
        fold_ln: fold every norm's gain (and LayerNorm bias) into the weights that read it; the
            norms then compute TransformerLens's LNPre / RMSPre.
        center_writing_weights: centre W_E, W_pos, W_O, b_O, W_out, b_out over d_model (LayerNorm only).
        center_unembed: centre W_U (and b_U) over the vocabulary (log-probabilities unchanged).
        fold_value_biases: fold b_V into b_O.

    Example:
        >>> import workbench as wb
        >>> model = wb.load_model("smollm2-135m", attn_impl="sdpa")   # doctest: +SKIP
        >>> model = wb.load_model("runs/my-model", attn_impl="flash")  # doctest: +SKIP
        >>> gpt2 = wb.load_model("checkpoints/gpt2", fold_ln=True, center_writing_weights=True,
        ...                      center_unembed=True, fold_value_biases=True)   # doctest: +SKIP
        >>> gpt2.cfg.weight_processing   # doctest: +SKIP
        ('fold_ln', 'center_writing_weights', 'center_unembed', 'fold_value_biases')
        >>> llama = wb.load_model("smollm2-135m", fold_ln=True, center_unembed=True)   # doctest: +SKIP
    """
    model = _load(source, attn_impl, dtype, device, progress)
    if fold_ln or center_writing_weights or center_unembed or fold_value_biases:
        model.process_weights_(fold_ln=fold_ln, center_writing_weights=center_writing_weights,
                               center_unembed=center_unembed, fold_value_biases=fold_value_biases)
    return model


def _load(source: Union[str, Path], attn_impl: str, dtype: Optional[torch.dtype], device: str,
          progress: Optional[bool]):
    """The model exactly as the checkpoint holds it, by whichever loader ``source`` calls for."""
    options = dict(attn_impl=attn_impl, dtype=dtype, device=device)
    if isinstance(source, str) and source in REGISTRY:
        source = REGISTRY[source].path()
    path = Path(source)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"{source}: no such file or directory, and not a registered model name (registered: {sorted(REGISTRY)})")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise CheckpointError(f"{path}: a file must be a .gguf checkpoint; for safetensors pass its directory")
        return load_gguf(path, progress=progress, **{**options, "dtype": dtype or torch.float32})
    config_path = path / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{config_path}: not found; a model directory needs config.json "
                              "(HF format or written by model.save())")
    if read_config(config_path).get("format") == FORMAT_TAG:
        return load_native(path, **options)
    if is_hf_directory(path):
        return load_hf_directory(path, progress=progress, **options)
    raise CheckpointError(f"{config_path}: neither an HF config (no field 'architectures' or 'model_type') "
                          f"nor one written by model.save() (no field 'format': '{FORMAT_TAG}')")


def supported_architectures() -> pd.DataFrame:
    """Every architecture ``load_model`` reads: format, architecture (as config.json or the GGUF
    file names it), model_type, and the models it covers.

    Example:
        >>> import workbench as wb
        >>> table = wb.supported_architectures()
        >>> "LlamaForCausalLM" in set(table.architecture), table.columns.tolist()
        (True, ['format', 'architecture', 'model_type', 'models'])
    """
    rows = [{"format": "HF directory", "architecture": architecture, "model_type": model_type, "models": models}
            for family in FAMILIES for architecture, (model_type, models) in family.ARCHITECTURES.items()]
    rows += [{"format": "GGUF", "architecture": arch, "model_type": arch, "models": models}
             for arch, models in GGUF_MODELS.items()]
    return pd.DataFrame(rows, columns=["format", "architecture", "model_type", "models"])
