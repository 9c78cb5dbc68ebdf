"""The Router page's results (mixture-of-experts models): expert load, each token's experts, router
entropy, shared experts beside routed ones, and the loss without one expert.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import streamlit as st
import torch

from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import router


@st.cache_data(show_spinner="Reading the router …", max_entries=16, hash_funcs=BY_MODEL_KEY)
def routing(loaded: LoadedModel, ids: tuple[int, ...]
            ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, Optional[pd.DataFrame]]:
    """A mixture-of-experts model's expert load, each token's chosen experts, the router entropy (MoE layers
    only) and, when it has shared experts, their output beside the routed experts' (else None).

    Example:
        >>> loaded = LoadedModel(wb.load_model("toy-moe-2l", progress=False).eval(), "toy-moe-2l|sdpa")
        >>> load, choices, entropy, shared = routing(loaded, (1, 2, 3, 4))
        >>> sorted(load["layer"].unique().tolist()), shared   # toy-moe-2l has no shared expert
        ([0, 1], None)
    """
    tokens, model = torch.tensor([ids]), loaded.model
    with loaded.lock:
        shared = router.shared_vs_routed(model, tokens) if router.shared_expert_layers(model) else None
        return (router.expert_load(model, tokens), router.token_expert_choices(model, tokens),
                router.router_entropy(model, tokens), shared)


@st.cache_data(show_spinner="Ablating the expert …", max_entries=32, hash_funcs=BY_MODEL_KEY)
def expert_ablation_effect(loaded: LoadedModel, ids: tuple[int, ...], layer: int, expert: int) -> dict:
    """The mean loss with and without expert ``expert`` of MoE layer ``layer``, and their difference.

    Example:
        >>> loaded = LoadedModel(wb.load_model("toy-moe-2l", progress=False).eval(), "toy-moe-2l|sdpa")
        >>> effect = expert_ablation_effect(loaded, (1, 2, 3, 4, 5), layer=0, expert=3)
        >>> bool(effect["delta"] == effect["ablated_loss"] - effect["clean_loss"])
        True
    """
    with loaded.lock:
        return router.expert_ablation_effect(loaded.model, torch.tensor([ids]), layer, expert)
