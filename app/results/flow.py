"""The Information flow page's results: every attention edge's, residual's and block's importance on the
prompt, and what one block writes in vocabulary terms.
"""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

from app.results.long_runs import LongRun, ProgressBar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import flow


def _flow_contributions(model, ids: tuple[int, ...], progress) -> "flow.FlowContributions":
    return flow.flow_contributions(model, torch.tensor([ids]), progress=progress)


_FLOW = LongRun("Tracing the information flow", _flow_contributions)


def flow_contributions(loaded: LoadedModel, ids: tuple[int, ...], bar: ProgressBar) -> "flow.FlowContributions":
    """Every attention edge's, residual's and block's importance on the prompt, and the pass's attention patterns
    (one forward pass, the MLP sums scored per layer with a progress bar; each attention sum is split into its parts
    when the graph or an edge first reads it); kept in the long-run store, not pickled.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> contributions = flow_contributions(LoadedModel(model, "toy-attn-2l|sdpa"), tuple(tokens[0].tolist()),
        ...                                    bar=quiet)
        >>> contributions.n_layers
        2
    """
    return _FLOW(loaded, ids, bar=bar)


@st.cache_data(show_spinner="Projecting the block onto the vocabulary …", max_entries=64, hash_funcs=BY_MODEL_KEY)
def flow_vocab_projection(loaded: LoadedModel, ids: tuple[int, ...], layer: int, position: int, block: str,
                          k: int) -> pd.DataFrame:
    """The tokens ``block``'s output at (layer, position) promotes and suppresses most (its direct effect).

    Example:
        >>> vocab = flow_vocab_projection(LoadedModel(model, "toy-attn-2l|sdpa"), tuple(tokens[0].tolist()),
        ...                               1, 3, "attn", 2)
        >>> vocab[["direction", "rank"]].values.tolist()
        [['promoted', 1], ['promoted', 2], ['suppressed', 1], ['suppressed', 2]]
    """
    with loaded.lock:
        return flow.vocab_projection(loaded.model, torch.tensor([ids]), layer, position, block, k)


def default_pick(edges: pd.DataFrame, special: tuple[int, ...]) -> int:
    """The index, among the attention edges (strongest first), of the strongest one joining two tokens that are
    not special; 0 when there is none.

    Example:
        >>> edges = pd.DataFrame({"kind": ["attention", "attention"], "source_position": [0, 1],
        ...                       "target_position": [0, 2]})
        >>> default_pick(edges, special=(0,)), default_pick(edges, special=())
        (1, 0)
    """
    attention = edges[edges["kind"] == "attention"].reset_index(drop=True)
    ordinary = attention[~attention["source_position"].isin(special) & ~attention["target_position"].isin(special)]
    return int(ordinary.index[0]) if len(ordinary) else 0
