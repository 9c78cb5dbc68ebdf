"""An SAE's feature activations on a prompt, read through the SAE spliced into the model with its error term
(so the model's own activations are untouched), and the features active at each token."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from experiments._tokens import str_tokens
from workbench.tokens_api import TextOrTokens
from workbench.errors import InputError
from workbench.sae import SAE


def check_feature(sae: SAE, feature: int) -> int:
    """``feature`` as an int after checking it is one of the SAE's ``d_sae`` features (else ``InputError``).

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=2, d_sae=3), {"W_enc": torch.ones(2, 3),
        ...     "W_dec": torch.ones(3, 2), "b_enc": torch.zeros(3), "b_dec": torch.zeros(2)})
        >>> check_feature(sae, 2)
        2
        >>> check_feature(sae, 3)
        Traceback (most recent call last):
        workbench.errors.InputError: feature 3 is out of range: this SAE has features 0..2 (d_sae=3)
    """
    if not isinstance(sae, SAE):
        raise InputError(f"sae must be a wb.SAE (wb.load_sae(path)), got {type(sae).__name__}")
    if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < sae.cfg.d_sae:
        raise InputError(f"feature {feature!r} is out of range: this SAE has features 0..{sae.cfg.d_sae - 1} "
                         f"(d_sae={sae.cfg.d_sae})")
    return int(feature)


def acts_hook_name(sae: SAE) -> str:
    """The model hook point carrying the SAE's feature activations while it is spliced (SAELens's cache key).

    Example:
        >>> acts_hook_name(wb.SAE(wb.SAEConfig("standard", d_in=2, d_sae=3,
        ...                                    metadata={"hook_name": "blocks.0.hook_resid_post"})))
        'blocks.0.hook_resid_post.hook_sae_acts_post'
    """
    if sae.cfg.hook_name is None:
        raise InputError(f"{sae!r} has no cfg.metadata.hook_name: set the hook point it reads")
    return f"{sae.cfg.hook_name_out}.hook_sae_acts_post"


def check_fits(model, sae: SAE) -> None:
    """An ``InputError`` naming both when ``sae``'s hooks or widths do not fit ``model`` (the splice's own check).

    Example:
        >>> check_fits(model, wb.SAE(wb.SAEConfig("standard", d_in=64, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"})))
        Traceback (most recent call last):
        workbench.errors.InputError: SAE(standard, d_in=64, d_sae=4, hook_name='blocks.0.hook_resid_post') has d_in=64, but this model's hook 'blocks.0.hook_resid_post' carries (128,) per token
    """
    check_feature(sae, 0)
    with model.saes(saes=[sae], use_error_term=True):
        pass


@contextmanager
def reading_features(model, sae: SAE) -> Iterator[tuple[str, int | None]]:
    """A block with ``sae`` spliced into ``model`` with its error term (outputs unchanged; an SAE that does not
    fit the model is an ``InputError`` naming both): yields the activations' hook name and the ``stop_at_layer``
    that runs just the blocks up to the SAE's hooks (None: the whole model).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> with reading_features(model, sae) as (name, stop):
        ...     name, stop
        ('blocks.0.hook_resid_post.hook_sae_acts_post', 1)
    """
    name = acts_hook_name(sae)
    with model.saes(saes=[sae], use_error_term=True):
        layers = [model.layer_of(hook) for hook in (sae.cfg.hook_name, sae.cfg.hook_name_out)]
        yield name, None if None in layers else max(layers) + 1


def run_features(model, name: str, stop: int | None, tokens_BP: Tensor) -> Float[Tensor, "batch pos d_sae"]:
    """Inside ``reading_features``: the feature activations of ``tokens_BP`` (float32), blocks up to ``stop``.

    Example:
        >>> sae = wb.SAE.from_tensors(wb.SAEConfig("topk", d_in=128, d_sae=16, k=3,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 16),
        ...     "W_dec": torch.randn(16, 128), "b_enc": torch.zeros(16), "b_dec": torch.zeros(128)})
        >>> with reading_features(model, sae) as (name, stop):
        ...     run_features(model, name, stop, tokens).shape   # only block 0 runs (stop 1)
        torch.Size([1, 14, 16])
    """
    _, cache = model.run_with_cache(tokens_BP, names_filter=[name], stop_at_layer=stop)
    return cache[name].float()


@torch.no_grad()
def feature_activations(model, sae: SAE, tokens: TextOrTokens) -> Float[Tensor, "batch pos d_sae"]:
    """Every feature of ``sae`` on every token (float32): ``hook_sae_acts_post`` with the SAE spliced in
    (SAELens's ``run_with_cache_with_saes``), running only the blocks up to the SAE's hook.

    Example:
        >>> _ = torch.manual_seed(0); sae = wb.SAE.from_tensors(wb.SAEConfig("topk", d_in=128, d_sae=16, k=3,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 16),
        ...     "W_dec": torch.randn(16, 128), "b_enc": torch.zeros(16), "b_dec": torch.zeros(128)})
        >>> acts_BPX = feature_activations(model, sae, tokens)
        >>> acts_BPX.shape, int((acts_BPX != 0).sum(-1).max())   # top-3: at most 3 features per token
        (torch.Size([1, 14, 16]), 3)
    """
    tokens_BP = model.as_tokens(tokens)
    with reading_features(model, sae) as (name, stop):
        return run_features(model, name, stop, tokens_BP)


def active_features(model, sae: SAE, tokens: TextOrTokens, k: int = 5) -> pd.DataFrame:
    """The ``k`` most active features at each token of the prompt (batch row 0), features at zero left out:
    DataFrame[position, token, rank, feature, activation], by position then rank.

    Example:
        >>> _ = torch.manual_seed(0); sae = wb.SAE.from_tensors(wb.SAEConfig("topk", d_in=128, d_sae=16, k=3,
        ...     metadata={"hook_name": "blocks.0.hook_resid_post"}), {"W_enc": torch.randn(128, 16),
        ...     "W_dec": torch.randn(16, 128), "b_enc": torch.zeros(16), "b_dec": torch.zeros(128)})
        >>> table = active_features(model, sae, "The cat", k=2)
        >>> list(table.columns), bool(table.groupby("position").size().max() <= 2)
        (['position', 'token', 'rank', 'feature', 'activation'], True)
    """
    if k < 1:
        raise InputError(f"k must be at least 1, got {k}")
    tokens_1P = model.as_tokens(tokens)[:1]
    acts_PX = feature_activations(model, sae, tokens_1P)[0].cpu()
    top_values, top_features = acts_PX.topk(min(k, acts_PX.shape[-1]), dim=-1)
    names = str_tokens(model, tokens_1P[0].cpu())
    rows = [{"position": p, "token": names[p], "rank": r + 1, "feature": int(top_features[p, r]),
             "activation": float(top_values[p, r])}
            for p in range(acts_PX.shape[0]) for r in range(top_values.shape[1]) if top_values[p, r] > 0]
    return pd.DataFrame(rows, columns=["position", "token", "rank", "feature", "activation"])


def feature_on_prompt(model, sae: SAE, tokens: TextOrTokens, feature: int) -> pd.DataFrame:
    """One feature on each token of the prompt (batch row 0): DataFrame[position, token, activation].

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> feature_on_prompt(model, sae, "The cat", 1).activation.tolist()   # zero weights: never fires
        [0.0, 0.0, 0.0, 0.0]
    """
    check_feature(sae, feature)
    tokens_1P: Int[Tensor, "1 pos"] = model.as_tokens(tokens)[:1]
    acts_P = feature_activations(model, sae, tokens_1P)[0, :, feature].cpu()
    return pd.DataFrame({"position": range(tokens_1P.shape[1]), "token": str_tokens(model, tokens_1P[0].cpu()),
                         "activation": acts_P.numpy()})
