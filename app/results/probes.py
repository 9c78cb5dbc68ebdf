"""The Probes page's results: probes per layer over typed examples, and a probe monitoring a generation."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import probes

MONITOR_MAX_NEW_TOKENS = 64


def resid_hooks(loaded: LoadedModel) -> tuple[str, ...]:
    """The residual stream after every layer, the hooks the page probes.

    Example:
        >>> resid_hooks(LoadedModel(model, "toy-attn-2l|sdpa"))
        ('blocks.0.hook_resid_post', 'blocks.1.hook_resid_post')
    """
    return tuple(f"blocks.{layer}.hook_resid_post" for layer in range(loaded.model.cfg.n_layers))


@st.cache_data(show_spinner="Fitting a probe at every layer …", max_entries=8, hash_funcs=BY_MODEL_KEY)
def probe_table(loaded: LoadedModel, first: tuple[str, ...], second: tuple[str, ...], kind: str) -> pd.DataFrame:
    """Held-out accuracy and AUROC of a probe at every layer telling ``first`` (label 0) from ``second`` (1).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> table = probe_table(loaded, ("import os", "x = 1", "def f():") * 2, ("the cat", "a dog", "we sing") * 2,
        ...                     "logistic")
        >>> table["hook_name"].tolist()
        ['blocks.0.hook_resid_post', 'blocks.1.hook_resid_post']
    """
    return _run(loaded, first, second, kind).table


@st.cache_data(show_spinner="Generating under the probe's watch …", max_entries=16, hash_funcs=BY_MODEL_KEY)
def monitored_generation(loaded: LoadedModel, first: tuple[str, ...], second: tuple[str, ...], kind: str,
                         hook_name: str, prompt: str, max_new_tokens: int) -> pd.DataFrame:
    """Each token of ``prompt`` and its greedy continuation with the probe's score (log-odds of ``second``)
    when the model read it; the last new token was never read, so it has none.

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> rows = monitored_generation(loaded, ("import os", "x = 1", "def f():") * 2, ("the cat", "a dog", "we sing") * 2,
        ...                             "logistic", "blocks.1.hook_resid_post", "import", 3)
        >>> list(rows.columns), len(rows)
        (['position', 'token', 'score', 'generated'], 4)
    """
    probe = _run(loaded, first, second, kind).probes[hook_name]
    n_new = max(1, min(int(max_new_tokens), MONITOR_MAX_NEW_TOKENS))
    with loaded.lock:
        prompt_ids = loaded.model.to_tokens(prompt)
        with probes.probe_monitor(loaded.model, probe, hook_name) as log:
            out = loaded.model.generate(prompt_ids, n_new, verbose=False)
    scores = log.scores()[0].tolist()
    tokens = loaded.model.to_str_tokens(out[0, :len(scores)])
    return pd.DataFrame({"position": range(len(scores)), "token": tokens, "score": scores,
                         "generated": [p >= prompt_ids.shape[1] for p in range(len(scores))]})


@st.cache_data(max_entries=8, hash_funcs=BY_MODEL_KEY, show_spinner=False)
def _run(loaded: LoadedModel, first: tuple[str, ...], second: tuple[str, ...], kind: str) -> probes.ProbeRun:
    with loaded.lock:
        return probes.train_probe(loaded.model, list(first) + list(second), [0] * len(first) + [1] * len(second),
                                  resid_hooks(loaded), kind=kind, whiten=kind == "mass_mean", test_fraction=0.25,
                                  progress=False)
