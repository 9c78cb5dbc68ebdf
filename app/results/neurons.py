"""The Neurons and Token view pages' results: one MLP neuron's activation on the prompt, its direct
effect on the logits, and the corpus windows where it fires most.
"""

from __future__ import annotations

from typing import Optional

import pandas as pd
import streamlit as st
import torch

from app.results.long_runs import LongRun, ProgressBar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import neurons
from experiments.corpus_windows import default_corpus
from experiments.plots.neurons import top_windows_html


@st.cache_data(show_spinner="Reading the neuron …", max_entries=64, hash_funcs=BY_MODEL_KEY)
def neuron_activation(loaded: LoadedModel, ids: tuple[int, ...], unit: neurons.MLPUnit, neuron: int) -> pd.DataFrame:
    """One MLP neuron's activation on each token of the prompt (NaN where a routed expert did not run).

    Example:
        >>> loaded = LoadedModel(wb.load_model("toy-moe-2l", progress=False).eval(), "toy-moe-2l|sdpa")
        >>> acts = neuron_activation(loaded, (1, 2, 3, 4), neurons.MLPUnit(0, expert=1), 17)
        >>> len(acts), acts["activation"].isna().tolist() == (~acts["routed"]).tolist()
        (4, True)
    """
    with loaded.lock:
        return neurons.neuron_activation(loaded.model, torch.tensor([ids]), unit, neuron)


@st.cache_data(show_spinner="Projecting the neuron onto the vocabulary …", max_entries=64, hash_funcs=BY_MODEL_KEY)
def neuron_logit_effect(loaded: LoadedModel, unit: neurons.MLPUnit, neuron: int, k: int,
                        through_final_norm: bool) -> pd.DataFrame:
    """The tokens the neuron's output weights promote and suppress most (weights only: no hook, no lock).

    Example:
        >>> loaded = LoadedModel(wb.load_model("toy-moe-2l", progress=False).eval(), "toy-moe-2l|sdpa")
        >>> effect = neuron_logit_effect(loaded, neurons.MLPUnit(0, expert=1), 17, k=3, through_final_norm=True)
        >>> effect["direction"].tolist()
        ['promoted', 'promoted', 'promoted', 'suppressed', 'suppressed', 'suppressed']
    """
    return neurons.direct_logit_effect(loaded.model, unit, neuron, k, through_final_norm)


def _corpus_maxima(model, unit: neurons.MLPUnit, n_windows: int, window: int, corpus: Optional[str],
                   progress) -> "neurons.CorpusMaxima":
    return neurons.corpus_maxima(model, unit, n_windows=n_windows, window=window, progress=progress, corpus=corpus)


_CORPUS_MAXIMA = LongRun("Finding every neuron's top windows in the corpus", _corpus_maxima)


def model_corpus(loaded: LoadedModel) -> str:
    """The corpus the open model reads by default ("english" or "code": the one it was trained on).

    Example:
        >>> model_corpus(loaded)   # doctest: +SKIP
        'english'
    """
    return default_corpus(loaded.model)


def neuron_corpus_maxima(loaded: LoadedModel, unit: neurons.MLPUnit, n_windows: int, window: int,
                         bar: ProgressBar, corpus: Optional[str] = None) -> "neurons.CorpusMaxima":
    """Every neuron of ``unit``'s max per window of ``corpus`` ("english", "code"; None: the model's own): from this process's store, the disk cache, or
    computed with a progress bar (then saved to disk).

    Example (on a page: it draws a bar, tokenizes the corpus for seconds and writes the disk cache,
    ``experiments.neurons.cache_directory()``):
        >>> loaded = load_model("toy-moe-2l", "sdpa")   # doctest: +SKIP
        >>> maxima = neuron_corpus_maxima(loaded, neurons.MLPUnit(0, expert=1), 256, 64,
        ...                               bar=app.widgets.progress_callback)   # doctest: +SKIP
        >>> maxima.max_BM.shape   # 256 windows, the expert's 256 neurons   # doctest: +SKIP
        torch.Size([256, 256])
    """
    return _CORPUS_MAXIMA(loaded, unit, n_windows, window, corpus, bar=bar)


def neuron_top_windows(loaded: LoadedModel, maxima: "neurons.CorpusMaxima", neuron: int,
                       k: int) -> tuple[pd.DataFrame, str]:
    """The ``k`` windows of ``maxima`` where ``neuron`` peaks highest, as a table and as HTML text with each
    window's peak token outlined. Not cached itself: it reads ``k`` rows of the stored ``maxima`` (the model
    only detokenizes them).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> maxima = neurons.CorpusMaxima(windows_BP=torch.tensor([[1, 2, 3], [4, 5, 6]]),
        ...                               max_BM=torch.tensor([[0.5], [2.0]]), argmax_BM=torch.tensor([[1], [2]]),
        ...                               path=None, from_disk=False)   # 2 windows of 3 tokens, 1 neuron
        >>> table, html = neuron_top_windows(loaded, maxima, 0, k=2)
        >>> table[["rank", "window", "position"]].values.tolist(), table["max_activation"].tolist()
        ([[1, 1, 2], [2, 0, 1]], [2.0, 0.5])
        >>> html.count('class="wb-token-view"')
        2
    """
    table = neurons.top_windows(loaded.model, maxima, neuron, k=k)
    return table, top_windows_html(loaded.model, maxima, table)
