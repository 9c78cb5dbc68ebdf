"""The dashboard's one cache layer: the loaded models, every cached experiment result, and the
store for long runs that report to a progress bar. Pages call these instead of caching anything.

Models are kept by ``st.cache_resource``: one copy per process, shared by every page and tab.
Results are kept by ``st.cache_data`` on the model's key string (``hash_funcs`` hashes a
``LoadedModel`` by its key, so Streamlit never hashes half a gigabyte of weights) and on the
token ids as a tuple. Every computation holds the model's lock while its hooks are on.

Long runs (head sweep, induction scan, head score table) report progress to a bar.
``st.cache_data`` records every element call made inside a cached function and replays it on a
cache hit, which fails for a bar created outside the function; so these runs keep their
results in a small process-wide LRU store (``st.cache_resource``) and drive the bar themselves.
The bar comes from the caller (``app.widgets.progress_callback``): this layer draws nothing of
its own and imports no widget or page.

Legend: P position, S key position, H n_heads, L n_layers.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Hashable, Optional

import pandas as pd
import streamlit as st
import torch

import workbench as wb
from app.state import LoadedModel
from experiments import ablation, attention, induction, lens, router

# (kind, layer, index) of each thing to ablate: tuples, so the ablation result can be cached on them.
Targets = tuple[tuple[str, int, Optional[int]], ...]
# Reference prompts' token ids for mean / resample ablation (None for zero ablation).
Reference = Optional[tuple[tuple[int, ...], ...]]
# ``(text) -> (report(done, total), finish())``: draws a progress bar and removes it.
ProgressBar = Callable[[str], tuple[Callable[[int, int], None], Callable[[], None]]]

_BY_MODEL_KEY = {LoadedModel: lambda loaded: loaded.key}
_LONG_RUNS_KEPT = 32


# Kept to three models: SmolLM2 in float32 is ~0.5 GiB and the machine may be small.
@st.cache_resource(show_spinner=False, max_entries=3)
def load_model(source: str, impl: str) -> LoadedModel:
    """The model at ``source`` (a registered name or a path) running kernel ``impl``, loaded once per process.

    Example:
        >>> load_model("toy-attn-2l", "sdpa").key   # doctest: +SKIP
        'toy-attn-2l|sdpa'
    """
    model = wb.load_model(source, attn_impl=impl)
    return LoadedModel(model.eval(), f"{source}|{impl}")


# Eight prompts' patterns: at the 256-token limit SmolLM2's are 70 MB each.
@st.cache_data(show_spinner="Computing attention patterns …", max_entries=8, hash_funcs=_BY_MODEL_KEY)
def attention_patterns(loaded: LoadedModel, ids: tuple[int, ...]) -> torch.Tensor:
    """Every head's pattern on the prompt: [n_layers, n_heads, P, S].

    Example:
        >>> patterns_LHPS = attention_patterns(loaded, prompt.ids)   # doctest: +SKIP
    """
    with loaded.lock:
        return attention.attention_patterns(loaded.model, torch.tensor([ids]))


@st.cache_data(show_spinner="Measuring the loss on both copies …", max_entries=16, hash_funcs=_BY_MODEL_KEY)
def induction_loss(loaded: LoadedModel, seq_len: int, batch: int, seed: int) -> pd.DataFrame:
    """The per-position loss on the first and second copy of ``batch`` repeated random sequences.

    Example:
        >>> loss = induction_loss(loaded, seq_len=50, batch=10, seed=0)   # doctest: +SKIP
        >>> loss.groupby("copy")["loss"].mean()                          # doctest: +SKIP
    """
    with loaded.lock:
        return induction.induction_loss(loaded.model, seq_len=seq_len, batch=batch, seed=seed)


@st.cache_data(show_spinner="Running the ablation …", max_entries=32, hash_funcs=_BY_MODEL_KEY)
def ablation_effects(loaded: LoadedModel, ids: tuple[int, ...], targets: Targets, method: str,
                     reference: Reference) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The per-token loss change and the top-5 next-token predictions, clean and with ``targets`` ablated.

    Example:
        >>> per_token, top = ablation_effects(loaded, prompt.ids, (("head", 1, 3),), "zero", None)   # doctest: +SKIP
    """
    tokens, ref = torch.tensor([ids]), (torch.tensor(reference) if reference else None)
    chosen = [ablation.AblationTarget(kind, layer, index) for kind, layer, index in targets]
    with loaded.lock:
        per_token = ablation.per_token_loss_change(loaded.model, tokens, chosen, method, ref)
        top = ablation.top_predictions_change(loaded.model, tokens, chosen, method, k=5, reference_tokens=ref)
    return per_token, top


@st.cache_data(show_spinner="Reading every layer through the unembedding …", max_entries=16,
               hash_funcs=_BY_MODEL_KEY)
def logit_lens(loaded: LoadedModel, ids: tuple[int, ...], top_k: int) -> pd.DataFrame:
    """The top ``top_k`` tokens each layer's residual stream predicts at each position.

    Example:
        >>> table = logit_lens(loaded, prompt.ids, top_k=5)   # doctest: +SKIP
    """
    with loaded.lock:
        return lens.logit_lens(loaded.model, torch.tensor([ids]), top_k=top_k)


@st.cache_data(show_spinner="Attributing the logit …", max_entries=32, hash_funcs=_BY_MODEL_KEY)
def direct_logit_attribution(loaded: LoadedModel, ids: tuple[int, ...], target: int, baseline: Optional[int],
                             position: int) -> pd.DataFrame:
    """Each component's direct contribution to the logit of ``target`` (minus ``baseline``) at ``position``.

    Example:
        >>> dla = direct_logit_attribution(loaded, prompt.ids, 262, None, position=-1)   # doctest: +SKIP
    """
    with loaded.lock:
        return lens.direct_logit_attribution(loaded.model, torch.tensor([ids]), target, baseline, position)


@st.cache_data(show_spinner="Reading the router …", max_entries=16, hash_funcs=_BY_MODEL_KEY)
def routing(loaded: LoadedModel, ids: tuple[int, ...]
            ) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, Optional[pd.DataFrame]]:
    """A mixture-of-experts model's expert load, each token's chosen experts, the router entropy (MoE layers
    only) and, when it has shared experts, their output beside the routed experts' (else None).

    Example:
        >>> load, choices, entropy, shared = routing(loaded, prompt.ids)   # doctest: +SKIP
    """
    tokens, model = torch.tensor([ids]), loaded.model
    with loaded.lock:
        shared = router.shared_vs_routed(model, tokens) if router.shared_expert_layers(model) else None
        return (router.expert_load(model, tokens), router.token_expert_choices(model, tokens),
                router.router_entropy(model, tokens), shared)


@st.cache_data(show_spinner="Ablating the expert …", max_entries=32, hash_funcs=_BY_MODEL_KEY)
def expert_ablation_effect(loaded: LoadedModel, ids: tuple[int, ...], layer: int, expert: int) -> dict:
    """The mean loss with and without expert ``expert`` of MoE layer ``layer``, and their difference.

    Example:
        >>> expert_ablation_effect(loaded, prompt.ids, layer=0, expert=3)["delta"]   # doctest: +SKIP
    """
    with loaded.lock:
        return router.expert_ablation_effect(loaded.model, torch.tensor([ids]), layer, expert)


@st.cache_resource(show_spinner=False)
def _long_run_store() -> tuple[OrderedDict, threading.Lock]:
    return OrderedDict(), threading.Lock()


def _run_key(loaded: LoadedModel, text: str, compute: Callable, args: tuple, kwargs: dict) -> tuple:
    return loaded.key, text, getattr(compute, "__qualname__", repr(compute)), args, tuple(sorted(kwargs.items()))


def with_progress(loaded: LoadedModel, text: str, compute: Callable[..., Any], *args: Hashable,
                  bar: ProgressBar, **kwargs: Hashable) -> Any:
    """``compute(model, *args, progress=report, **kwargs)`` with a progress bar, cached on the arguments.

    ``bar(text)`` draws the bar and returns its ``report(done, total)`` and ``finish()``; it is
    called only when ``compute`` runs. ``args`` and ``kwargs`` must be hashable (token ids as
    tuples); tensors are rebuilt by the caller's ``compute``. A repeated call returns the stored
    result without running or drawing anything.

    Example:
        >>> df = with_progress(loaded, "Sweeping heads", lambda m, ids, progress: head_sweep(
        ...     m, torch.tensor([ids]), progress=progress), prompt.ids, bar=progress_callback)   # doctest: +SKIP
    """
    store, store_lock = _long_run_store()
    key = _run_key(loaded, text, compute, args, kwargs)
    with store_lock:
        if key in store:
            store.move_to_end(key)
            return store[key]
    report, finish = bar(text)
    try:
        with loaded.lock:
            result = compute(loaded.model, *args, progress=report, **kwargs)
    finally:
        finish()
    with store_lock:
        store[key] = result
        while len(store) > _LONG_RUNS_KEPT:
            store.popitem(last=False)
    return result


def has_result(loaded: LoadedModel, text: str, compute: Callable[..., Any], *args: Hashable,
               **kwargs: Hashable) -> bool:
    """Whether ``with_progress`` with these arguments would return a stored result at once.

    Example:
        >>> has_result(loaded, "Sweeping heads", sweep, prompt.ids)   # doctest: +SKIP
        False
    """
    store, store_lock = _long_run_store()
    key = _run_key(loaded, text, compute, args, kwargs)
    with store_lock:
        return key in store
