"""Checking ``train_sae``'s and ``evaluate_sae``'s arguments before anything runs, and reading their data.

Legend: B batch, P position.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from jaxtyping import Int
from torch import Tensor

from experiments._depth import hook_layer, stop_at_layer_for  # noqa: F401 - hook_layer is part of this module's API
from experiments.sae.activations import kept_positions, special_token_ids
from experiments.sae.modules import K_KIND, SAVED_AS, TRAINABLE
from workbench.errors import InputError

B_DEC_INITS = ("mean", "geometric_median", "zeros")
# TrainSAEConfig's counts and their least values (a float or NaN size would never fill the buffer or step).
WHOLE_NUMBERS = {"training_tokens": 1, "train_batch_size_tokens": 1, "buffer_tokens": 1, "store_batch_size_prompts": 1,
                 "dead_feature_window": 1, "log_every": 1, "checkpoint_every": 0, "lr_warm_up_steps": 0,
                 "lr_decay_steps": 0, "l1_warm_up_steps": 0, "l0_warm_up_steps": 0, "seed": 0}


def token_rows(model, data: Any, window: int = 128) -> Int[Tensor, "B P"]:
    """``data`` as token rows: an integer tensor [B, P] as it is, texts or a path cut into ``window``-token windows
    (``experiments.datasets.corpus_windows``). Anything else is an ``InputError`` naming ``data``.

    Example:
        >>> token_rows(model, torch.tensor([[1, 2, 3]])).shape
        torch.Size([1, 3])
        >>> token_rows(model, torch.tensor([1.5]))
        Traceback (most recent call last):
        workbench.errors.InputError: data must be token ids [batch, pos] (an integer tensor), texts or a path; got a float32 tensor of shape [1]
    """
    if isinstance(data, Tensor):
        if data.dim() != 2 or data.dtype not in (torch.int64, torch.int32) or data.numel() == 0:
            raise InputError(f"data must be token ids [batch, pos] (an integer tensor), texts or a path; got a "
                             f"{str(data.dtype).removeprefix('torch.')} tensor of shape {list(data.shape)}")
        return data.long().cpu()
    if isinstance(data, (str, Path, list, tuple)):
        from experiments.datasets.corpus import corpus_windows

        return corpus_windows(model, data, window=window).cpu()
    raise InputError(f"data must be token ids [batch, pos], texts or a path, got {type(data).__name__}")


def check_hook(model, hook_name: Any, argument: str) -> None:
    """An ``InputError`` naming ``argument`` unless ``hook_name`` is one of the model's hook points.

    Example:
        >>> check_hook(model, "blocks.1.hook_resid_post", "hook_name")
        >>> check_hook(model, "blocks.9.hook_resid_post", "hook_name")
        Traceback (most recent call last):
        workbench.errors.InputError: hook_name='blocks.9.hook_resid_post' is not a hook point of the model (e.g. blocks.0.hook_resid_post, blocks.1.hook_resid_post; model.hook_dict lists them)
    """
    if not isinstance(hook_name, str) or hook_name not in model.hook_dict:
        resid = [n for n in model.hook_dict if n.endswith("hook_resid_post")][:2]
        raise InputError(f"{argument}={hook_name!r} is not a hook point of the model (e.g. {', '.join(resid)}; "
                         "model.hook_dict lists them)")


def check_train_inputs(model, hook_name: Any, hook_name_out: Any, architecture: Any, d_sae: Any, k: Any, skip: Any,
                       cfg: Any, tokens: Tensor) -> tuple[int, int]:
    """Every ``train_sae`` argument checked (``InputError`` naming the first bad one); returns (d_in, d_out),
    read from one short forward pass.

    Example:
        >>> from experiments.sae.train import TrainSAEConfig
        >>> check_train_inputs(model, "blocks.0.hook_resid_post", None, "topk", 64, 4, False, TrainSAEConfig(), tokens)
        (128, 128)
        >>> check_train_inputs(model, "blocks.0.hook_resid_post", None, "topq", 64, 4, False, TrainSAEConfig(), tokens)
        Traceback (most recent call last):
        workbench.errors.InputError: architecture must be one of ('standard', 'jumprelu', 'topk', 'batchtopk', 'matryoshka_batchtopk'), got 'topq'
    """
    if architecture not in TRAINABLE:
        raise InputError(f"architecture must be one of {TRAINABLE}, got {architecture!r}")
    check_matryoshka_aux_loss(architecture, cfg)
    check_hook(model, hook_name, "hook_name")
    if hook_name_out is not None:
        check_hook(model, hook_name_out, "hook_name_out")
        if SAVED_AS[architecture][1] is None:
            raise InputError(f"architecture={architecture!r} cannot be a transcoder: SAELens has no top-k transcoder "
                             "format (train 'batchtopk', saved as jumprelu_transcoder)")
    if skip and hook_name_out is None:
        raise InputError("skip=True is for transcoders: give hook_name_out (the hook the transcoder predicts)")
    if isinstance(d_sae, bool) or not isinstance(d_sae, int) or d_sae < 1:
        raise InputError(f"d_sae must be a positive integer, got {d_sae!r}")
    if K_KIND[architecture] is not None:
        if isinstance(k, bool) or not isinstance(k, (int, float)) or not 0 < k <= d_sae:
            raise InputError(f"k must be a number of features from 1 to d_sae={d_sae} for a {architecture} SAE, got {k!r}")
        if K_KIND[architecture] == "integer" and k != int(k):
            raise InputError(f"k must be an integer for a topk SAE, got {k!r}")
    check_train_config(cfg, tokens, special_token_ids(model) if cfg.exclude_special_tokens else [])
    if tokens.max() >= model.cfg.d_vocab or tokens.min() < 0:
        raise InputError(f"data holds token ids outside the vocabulary [0, {model.cfg.d_vocab})")
    return hook_widths(model, [hook_name] + ([hook_name_out] if hook_name_out else []), tokens)


def check_matryoshka_aux_loss(architecture: str, cfg: Any) -> None:
    """An ``InputError`` naming ``use_matryoshka_aux_loss`` unless it is True or False, and False for every
    architecture but ``matryoshka_batchtopk`` (the per-level aux-k loss needs its levels; elsewhere the option
    would be silently ignored).

    Example:
        >>> from experiments.sae.train import TrainSAEConfig
        >>> check_matryoshka_aux_loss("batchtopk", TrainSAEConfig(use_matryoshka_aux_loss=True))
        Traceback (most recent call last):
        workbench.errors.InputError: use_matryoshka_aux_loss=True is for architecture='matryoshka_batchtopk' only (its per-level aux-k loss), got architecture='batchtopk'
    """
    value = cfg.use_matryoshka_aux_loss
    if not isinstance(value, bool):
        raise InputError(f"use_matryoshka_aux_loss must be True or False, got {value!r}")
    if value and architecture != "matryoshka_batchtopk":
        raise InputError("use_matryoshka_aux_loss=True is for architecture='matryoshka_batchtopk' only (its "
                         f"per-level aux-k loss), got architecture={architecture!r}")


def check_train_config(cfg: Any, tokens: Tensor, exclude: Sequence[int]) -> None:
    """An ``InputError`` naming the first ``TrainSAEConfig`` field that is of the wrong type or would keep training
    from progressing: sizes that are not whole numbers (a NaN buffer never fills), a buffer smaller than a batch,
    an ``outlier_norm_ratio`` under 1 or not finite (it could leave every row out: the median row's norm is 1x the
    median), or data whose every position is a special token left out (no row would ever reach the buffer).

    Example:
        >>> from experiments.sae.train import TrainSAEConfig
        >>> check_train_config(TrainSAEConfig(outlier_norm_ratio=0.0), torch.tensor([[5, 6]]), [0])
        Traceback (most recent call last):
        workbench.errors.InputError: outlier_norm_ratio must be a finite number of at least 1 (rows with a norm above that many times the median are left out), or None; got 0.0
    """
    for name, least in WHOLE_NUMBERS.items():
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise InputError(f"{name} must be a whole number of at least {least}, got {value!r}")
    if cfg.total_steps < 1:
        raise InputError(f"training_tokens={cfg.training_tokens} is less than one batch of "
                         f"train_batch_size_tokens={cfg.train_batch_size_tokens}")
    if cfg.buffer_tokens < cfg.train_batch_size_tokens:
        raise InputError(f"buffer_tokens={cfg.buffer_tokens} must be at least train_batch_size_tokens="
                         f"{cfg.train_batch_size_tokens}")
    ratio = cfg.outlier_norm_ratio
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not math.isfinite(ratio) or ratio < 1):
        raise InputError("outlier_norm_ratio must be a finite number of at least 1 (rows with a norm above that "
                         f"many times the median are left out), or None; got {ratio!r}")
    if cfg.b_dec_init not in B_DEC_INITS:
        raise InputError(f"b_dec_init must be one of {B_DEC_INITS}, got {cfg.b_dec_init!r}")
    for name in ("lr", "adam_beta1", "adam_beta2"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise InputError(f"{name} must be a positive finite number, got {value!r}")
    if not kept_positions(tokens, exclude).any():
        raise InputError(f"data holds only special tokens {list(exclude)}, which exclude_special_tokens leaves out: "
                         "no activation would reach the training buffer")


def hook_widths(model, hook_names: list[str], tokens: Tensor) -> tuple[int, int]:
    """The last-axis widths of the hooks (the first and the last), from a forward pass over two tokens.

    Example:
        >>> hook_widths(model, ["blocks.0.ln1.hook_normalized", "blocks.0.hook_attn_out"], tokens)
        (128, 128)
    """
    stop = stop_at_layer_for(model, hook_names)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens[:1, :2].to(model.cfg.device), names_filter=hook_names,
                                        stop_at_layer=stop, return_type=None)
    widths = [cache[h].shape[-1] for h in hook_names]
    for h in hook_names:
        if cache[h].dim() != 3:
            raise InputError(f"hook {h!r} gives activations of shape {list(cache[h].shape)}; an SAE here needs "
                             "[batch, pos, width] (attention heads' hook_z are not trainable here yet)")
    return widths[0], widths[-1]
