"""The Logit lens page's results: what each layer's residual stream predicts (through the logit lens, or a tuned
lens held by ``app.results.artifacts``), its KL to the model's output by layer, and each component's direct
contribution to one logit.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Optional

import pandas as pd
import streamlit as st
import torch

from app.results.artifacts import BY_ARTIFACT_KEY, LoadedArtifact
from app.results.long_runs import held_store
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import lens
from experiments.lenses import lens_kl_by_layer


# The prompt's one run, read by its logit lens and every attribution asked of it (a new target, baseline, position,
# top-k or window reads it again: no forward). Held in a small process-wide store (``held_store``), not pickled by
# st.cache_data (13.6 MB on SmolLM2 at 64 tokens: 23 ms of each prompt change), and read only (a test holds the
# readers to that). A new prompt's run is made by the logit lens itself, which reads each layer through the
# unembedding as the pass reaches it (``experiments.lens.logit_lens_with_cache``).
RUNS_HELD = 4


def _held_run(loaded: LoadedModel, ids: tuple[int, ...]) -> Optional[Mapping[str, torch.Tensor]]:
    return held_store("lens runs", RUNS_HELD).get((loaded.key, ids))


def _hold(loaded: LoadedModel, ids: tuple[int, ...], cache) -> Mapping[str, torch.Tensor]:
    run = MappingProxyType({name: cache[name] for name in cache.keys()})
    held_store("lens runs", RUNS_HELD).put((loaded.key, ids), run)
    return run


def _run_names(model) -> list[str]:
    """What the held run caches: the lens's snapshots and, where direct logit attribution applies, what it reads."""
    names = lens.snapshot_hook_names(model)
    if model.cfg.norm_placement != "post":  # direct logit attribution refuses post-norm models itself
        names += [name for name in lens.attribution_hook_names(model) if name not in names]
    return names


def _run_of(loaded: LoadedModel, ids: tuple[int, ...]) -> Mapping[str, torch.Tensor]:
    """The prompt's held run, or a new one (then held)."""
    run = _held_run(loaded, ids)
    if run is None:
        with loaded.lock, torch.no_grad():
            _, cache = loaded.model.run_with_cache(torch.tensor([ids]), stop_at_layer=loaded.model.cfg.n_layers,
                                                   names_filter=_run_names(loaded.model))
        run = _hold(loaded, ids, cache)
    return run


def _lens_table(loaded: LoadedModel, ids: tuple[int, ...], top_k: int, positions: Optional[tuple[int, int]],
                workers: int, held: Optional[LoadedArtifact] = None) -> pd.DataFrame:
    """The logit lens (through the tuned lens ``held`` when one is given) read from the prompt's held run, or read
    during a new run (then held)."""
    run = _held_run(loaded, ids)
    with loaded.lock:
        options = dict(top_k=top_k, screen=True, positions=_span(positions), workers=workers,
                       tuned_lens=held.artifact.attach(loaded.model) if held is not None else None)
        if run is not None:
            return lens.logit_lens(loaded.model, torch.tensor([ids]), cache=run, **options)
        table, cache = lens.logit_lens_with_cache(loaded.model, torch.tensor([ids]),
                                                  names_filter=_run_names(loaded.model), **options)
    _hold(loaded, ids, cache)
    return table


@st.cache_data(show_spinner="Reading every layer through the unembedding …", max_entries=16, hash_funcs=BY_MODEL_KEY)
def logit_lens(loaded: LoadedModel, ids: tuple[int, ...], top_k: int,
               positions: Optional[tuple[int, int]] = None, workers: int = 1) -> pd.DataFrame:
    """The top ``top_k`` tokens each layer's residual stream predicts at each position (``positions``: the first and
    last position read; default every one), the vocabulary read by ``workers`` threads (the page passes
    ``app.runtime.readout_workers()``).

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> table = logit_lens(loaded, tuple(tokens[0].tolist()), top_k=3)
        >>> sorted(table["rank"].unique().tolist())
        [1, 2, 3]
        >>> logit_lens(loaded, tuple(tokens[0].tolist()), 3, positions=(2, 4)).position.unique().tolist()
        [2, 3, 4]
    """
    return _lens_table(loaded, ids, top_k, positions, workers)


@st.cache_data(show_spinner="Attributing the logit …", max_entries=32, hash_funcs=BY_MODEL_KEY)
def direct_logit_attribution(loaded: LoadedModel, ids: tuple[int, ...], target: int, baseline: Optional[int],
                             position: int) -> pd.DataFrame:
    """Each component's direct contribution to the logit of ``target`` (minus ``baseline``) at ``position``.

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> dla = direct_logit_attribution(loaded, tuple(tokens[0].tolist()), 262, None, position=-1)
        >>> bool(abs(dla["attribution"].sum() - dla.attrs["logit_diff"]) < 1e-3)   # the parts sum to the logit
        True
    """
    run = _run_of(loaded, ids)  # before the lock: the run takes it itself
    with loaded.lock:
        return lens.direct_logit_attribution(loaded.model, torch.tensor([ids]), target, baseline, position, cache=run)


@st.cache_data(show_spinner="Reading every layer through the tuned lens …", max_entries=16,
               hash_funcs={**BY_MODEL_KEY, **BY_ARTIFACT_KEY})
def tuned_lens_table(loaded: LoadedModel, ids: tuple[int, ...], top_k: int, held: LoadedArtifact,
                     positions: Optional[tuple[int, int]] = None, workers: int = 1) -> pd.DataFrame:
    """``logit_lens``'s table with each layer's residual stream moved by the tuned lens ``held`` first.

    Example:
        >>> from experiments.lenses import TunedLens
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> held = LoadedArtifact("lens", "/demo", TunedLens.for_model(model), "demo")   # identity translators
        >>> table = tuned_lens_table(loaded, tuple(tokens[0].tolist()), 3, held)
        >>> table.equals(logit_lens(loaded, tuple(tokens[0].tolist()), 3))   # an untrained lens is the logit lens
        True
    """
    return _lens_table(loaded, ids, top_k, positions, workers, held)


def _span(positions: Optional[tuple[int, int]]) -> Optional[range]:
    return None if positions is None else range(positions[0], positions[1] + 1)


@st.cache_data(show_spinner="KL to the model's output, layer by layer …", max_entries=16,
               hash_funcs={**BY_MODEL_KEY, **BY_ARTIFACT_KEY})
def lens_kl(loaded: LoadedModel, ids: tuple[int, ...], held: Optional[LoadedArtifact]) -> pd.DataFrame:
    """KL and cross-entropy by layer on the prompt: the logit lens, and the tuned lens ``held`` when one is given.

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> sorted(lens_kl(loaded, tuple(tokens[0].tolist()), None)["lens"].unique())
        ['logit']
    """
    with loaded.lock:
        tuned = held.artifact.attach(loaded.model) if held is not None else None
        return lens_kl_by_layer(loaded.model, torch.tensor([ids]), tuned)
