"""The Features page's results: the SAEs a model can be browsed with, an SAE loaded once per process, the
features active on the prompt, a feature's card (its activation, logit effect, corpus top windows and density)
and a generation steered with it.

An SAE is kept by ``st.cache_resource`` (``load_sae``) under its path, the stamp of its files (so a rewritten
SAE is read again) and the model it is for; results are cached on the model's key and the SAE's key
(``BY_KEYS``), never by hashing weights. Every call that splices the SAE into the model holds the model's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pandas as pd
import streamlit as st
import torch

import workbench as wb
from app.results.artifacts import artifact_choices, load_artifact
from app.results.long_runs import LongRun, ProgressBar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import features
from experiments.continuations import Continuations
from experiments.plots.neurons import top_windows_html

# The corpus sizes a pass runs over: any requested number of windows (a link can carry any) becomes the next of
# these, so the passes a page can start, and the cache files they write, are at most these times the window
# lengths per SAE.
CORPUS_WINDOW_COUNTS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class LoadedSAE:
    """An SAE opened for one model, with the key its results are cached under (path, file stamp, model).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> LoadedSAE(sae, "demo").key
        'demo'
    """

    sae: wb.SAE = field(compare=False, repr=False)
    key: str


BY_KEYS = {**BY_MODEL_KEY, LoadedSAE: lambda loaded_sae: loaded_sae.key}


def sae_choices(loaded: LoadedModel) -> dict[str, Path]:
    """The SAEs shipped for the open model (``app.results.artifacts``: rows of ``wb.shipped``), by label: the one
    list the page offers before "a path on this machine".

    Example:
        >>> list(sae_choices(LoadedModel(model, "no-such-model|sdpa")))   # the model is toy-attn-2l, which ships one
        ['toy-attn-2l-resid1-topk (blocks.1.hook_resid_post)']
    """
    return artifact_choices(loaded, "sae")


def load_sae(loaded: LoadedModel, path: str) -> LoadedSAE:
    """The SAE at ``path`` (a SAELens-format directory) on the model's device, loaded once per process and
    again when its files change (``app.results.artifacts``, the one holder). Load errors (``wb.CheckpointError``,
    ``wb.ConfigError``) propagate.

    Example:
        >>> load_sae(LoadedModel(model, "toy-attn-2l|sdpa"), "/no/such/sae")
        Traceback (most recent call last):
        workbench.errors.CheckpointError: /no/such/sae: no such directory (an SAE is a directory with cfg.json and sae_weights.safetensors)
    """
    held = load_artifact(loaded, "sae", path)
    return LoadedSAE(held.artifact, held.key)


@st.cache_data(show_spinner=False, max_entries=32, hash_funcs=BY_KEYS)
def fit_error(loaded: LoadedModel, loaded_sae: LoadedSAE) -> Optional[str]:
    """Why the SAE cannot be used with the model (its hook or width does not fit), or None.

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=64, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> fit_error(LoadedModel(model, "toy-attn-2l|sdpa"), LoadedSAE(sae, "doctest-64"))
        "SAE(standard, d_in=64, d_sae=4, hook_name='blocks.0.hook_resid_post') has d_in=64, but this model's hook 'blocks.0.hook_resid_post' carries (128,) per token"
    """
    with loaded.lock:
        try:
            features.check_fits(loaded.model, loaded_sae.sae)
        except wb.InputError as error:
            return str(error)
    return None


@st.cache_data(show_spinner="Reading the SAE's features …", max_entries=64, hash_funcs=BY_KEYS)
def active_features(loaded: LoadedModel, loaded_sae: LoadedSAE, ids: tuple[int, ...], k: int) -> pd.DataFrame:
    """The ``k`` most active features at each token of the prompt (``experiments.features.active_features``).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> active_features(LoadedModel(model, "toy-attn-2l|sdpa"), LoadedSAE(sae, "doctest-zero"), (1, 2, 3), 2).empty
        True
    """
    with loaded.lock:
        return features.active_features(loaded.model, loaded_sae.sae, torch.tensor([ids]), k)


def top_features_by_token(table: pd.DataFrame) -> pd.DataFrame:
    """An ``active_features`` table (one row per token and rank) as one row per token: its position, its text and
    its top features by rank, each as "feature (activation)".

    Example:
        >>> table = pd.DataFrame({"position": [0, 1, 1], "token": ["a", "b", "b"], "rank": [1, 1, 2],
        ...                       "feature": [7, 2, 7], "activation": [1.0, 3.0, 0.5]})
        >>> top_features_by_token(table).values.tolist()
        [[0, 'a', '7 (1.000)', ''], [1, 'b', '2 (3.000)', '7 (0.500)']]
    """
    cells = table.assign(cell=[f"{f} ({a:.3f})" for f, a in zip(table["feature"], table["activation"])])
    wide = cells.pivot(index=["position", "token"], columns="rank", values="cell").fillna("")
    wide.columns = [f"#{rank}" for rank in wide.columns]
    return wide.reset_index()


@st.cache_data(show_spinner="Reading the feature …", max_entries=64, hash_funcs=BY_KEYS)
def feature_on_prompt(loaded: LoadedModel, loaded_sae: LoadedSAE, ids: tuple[int, ...], feature: int) -> pd.DataFrame:
    """One feature's activation on each token of the prompt.

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> feature_on_prompt(LoadedModel(model, "toy-attn-2l|sdpa"), LoadedSAE(sae, "doctest-zero"), (1, 2), 3).shape
        (2, 3)
    """
    with loaded.lock:
        return features.feature_on_prompt(loaded.model, loaded_sae.sae, torch.tensor([ids]), feature)


@st.cache_data(show_spinner="Projecting the feature onto the vocabulary …", max_entries=64, hash_funcs=BY_KEYS)
def feature_logit_effect(loaded: LoadedModel, loaded_sae: LoadedSAE, feature: int, k: int,
                         through_final_norm: bool) -> pd.DataFrame:
    """The tokens the feature's decoder direction promotes and suppresses most (weights only: no hook, no lock).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> len(feature_logit_effect(LoadedModel(model, "toy-attn-2l|sdpa"), LoadedSAE(sae, "doctest-zero"), 1, 3, True))
        6
    """
    return features.feature_logit_effect(loaded.model, loaded_sae.sae, feature, k, through_final_norm)


def _corpus_stats(model, loaded_sae: LoadedSAE, n_windows: int, window: int, corpus: Optional[str],
                  progress) -> features.FeatureStats:
    chosen = {} if corpus is None else {"corpus": corpus}  # None: the experiment's default, the model's own corpus
    return features.feature_corpus_stats(model, loaded_sae.sae, n_windows=n_windows, window=window, progress=progress,
                                         **chosen)


_CORPUS_STATS = LongRun("Finding every feature's top windows and density in the corpus", _corpus_stats)


def corpus_window_count(n_windows: int) -> int:
    """The corpus size a pass asked for ``n_windows`` windows runs over: the smallest of ``CORPUS_WINDOW_COUNTS``
    that is at least ``n_windows`` (the largest past them).

    Example:
        >>> corpus_window_count(16), corpus_window_count(300), corpus_window_count(10**9), corpus_window_count(-5)
        (16, 512, 4096, 8)
    """
    return next((count for count in CORPUS_WINDOW_COUNTS if count >= n_windows), CORPUS_WINDOW_COUNTS[-1])


def feature_corpus_stats(loaded: LoadedModel, loaded_sae: LoadedSAE, n_windows: int, window: int,
                         bar: ProgressBar, corpus: Optional[str] = None) -> features.FeatureStats:
    """Every feature's top corpus windows and density histogram over ``corpus_window_count(n_windows)`` windows of
    ``window`` tokens (at most the model's context) of ``corpus`` ("english", "code"; None: the model's own): from this process's store, the disk cache, or computed with a
    progress bar (then saved to disk). Whatever a link asks, the passes and cache files per SAE stay within
    ``CORPUS_WINDOW_COUNTS`` times the window lengths.

    Example (on a page: it draws a bar and writes the disk cache):
        >>> stats = feature_corpus_stats(loaded, loaded_sae, 256, 64, bar=app.widgets.progress_callback)   # doctest: +SKIP
    """
    return _CORPUS_STATS(loaded, loaded_sae, corpus_window_count(int(n_windows)),
                         min(int(window), loaded.model.cfg.n_ctx), corpus, bar=bar)


def feature_top_windows(loaded: LoadedModel, stats: features.FeatureStats, feature: int,
                        k: int) -> tuple[pd.DataFrame, str]:
    """The ``k`` windows where ``feature`` peaks highest, as a table and as HTML text with each window's peak
    token outlined (the Neurons page's drawing). Not cached: it reads ``k`` rows of the stored ``stats``.

    Example:
        >>> stats = features.FeatureStats(torch.tensor([[1, 2, 3]]), torch.tensor([[2.0]]), torch.tensor([[0]]),
        ...                               torch.tensor([[1]]), torch.zeros(1, 40, dtype=torch.long), 2, None, False)
        >>> table, html = feature_top_windows(LoadedModel(model, "toy-attn-2l|sdpa"), stats, 0, k=3)
        >>> table["position"].tolist(), html.count('class="wb-token-view"')
        ([1], 1)
    """
    table = features.feature_top_windows(loaded.model, stats, feature, k=k)
    return table, top_windows_html(loaded.model, stats, table)


def feature_density(stats: features.FeatureStats, feature: int) -> pd.DataFrame:
    """``feature``'s density histogram from the stored ``stats`` (not cached: a view of one row).

    Example:
        >>> stats = features.FeatureStats(torch.tensor([[1, 2, 3]]), torch.tensor([[2.0]]), torch.tensor([[0]]),
        ...                               torch.tensor([[1]]), torch.ones(1, 40, dtype=torch.long), 40, None, False)
        >>> float(feature_density(stats, 0)["fraction"].sum())
        1.0
    """
    return features.feature_density(stats, feature)


@st.cache_data(show_spinner="Generating both continuations …", max_entries=32, hash_funcs=BY_KEYS)
def feature_continuation(loaded: LoadedModel, loaded_sae: LoadedSAE, ids: tuple[int, ...], feature: int, mode: str,
                         value: float, max_new_tokens: int) -> Continuations:
    """The prompt's greedy continuation, clean and with ``feature`` edited (``FeatureEdit(feature, mode, value)``:
    "add" steers by ``value`` x its decoder direction, "clamp" sets its activation; ``continue_with_feature``).

    Example:
        >>> sae = wb.SAE(wb.SAEConfig("standard", d_in=128, d_sae=4, metadata={"hook_name": "blocks.0.hook_resid_post"}))
        >>> result = feature_continuation(LoadedModel(model, "toy-attn-2l|sdpa"), LoadedSAE(sae, "doctest-zero"),
        ...                               tuple(tokens[0].tolist()), 1, "add", 5.0, 3)
        >>> result.clean_tokens == result.ablated_tokens   # a zero decoder row changes nothing
        True
    """
    with loaded.lock:
        return features.continue_with_feature(loaded.model, loaded_sae.sae, torch.tensor([ids]),
                                              features.FeatureEdit(feature, mode, value), max_new_tokens)
