"""The Patching page's results: IOI prompts, attribution patching (one backward pass) and exact
patching (one patched run per site, with a progress bar).
"""

from __future__ import annotations

import functools

import pandas as pd
import streamlit as st

from app.results.long_runs import LongRun, ProgressBar
from app.results.models import BY_MODEL_KEY
from app.state import LoadedModel
from experiments import datasets, patching

# Clean texts, corrupted texts, and one answer and one wrong token id per prompt: hashable, so results cache on them.
PatchPrompts = tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...], tuple[int, ...]]


@st.cache_data(show_spinner="Generating the IOI prompts …", max_entries=16, hash_funcs=BY_MODEL_KEY)
def ioi_prompts(loaded: LoadedModel, n: int, seed: int) -> PatchPrompts:
    """``n`` IOI prompts and their corrupted twins (``experiments.datasets.ioi_dataset``) with their answers.

    Example (SmolLM2: the zoo's code tokenizer splits every name, so it has no IOI prompts):
        >>> clean, corrupt, answers, wrongs = ioi_prompts(load_model("smollm2-135m", "sdpa"), 8, seed=0)  # doctest: +SKIP
        >>> len(clean), len(answers)   # doctest: +SKIP
        (8, 8)
    """
    data = datasets.ioi_dataset(loaded.model, n, seed=seed)
    return (tuple(data.clean_prompts), tuple(data.corrupt_prompts), tuple(data.answer_tokens.tolist()),
            tuple(data.wrong_tokens.tolist()))


@st.cache_data(show_spinner="Attribution patching …", max_entries=16, hash_funcs=BY_MODEL_KEY)
def attribution_patching(loaded: LoadedModel, prompts: PatchPrompts) -> pd.DataFrame:
    """Every site's attribution-patching estimate (one forward each, one backward); the unpatched metrics in attrs.

    Example:
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> prompts = (("The cat sat on the mat",), ("The dog sat on the mat",), (model.to_single_token(" the"),),
        ...            (model.to_single_token(" c"),))
        >>> approx = attribution_patching(loaded, prompts)
        >>> approx["site"].unique().tolist(), sorted(k for k in approx.attrs if k.endswith("_metric"))
        (['resid', 'attn', 'heads'], ['clean_metric', 'corrupt_metric'])
    """
    with loaded.lock:
        return patching.attribution_patching(loaded.model, _pairs(loaded.model, prompts))


_EXACT_PATCHING = {"resid": patching.patch_residual, "attn_mlp": patching.patch_attn_mlp, "heads": patching.patch_heads}
_EXACT_TEXT = {"resid": "Patching the residual stream", "attn_mlp": "Patching attention and MLP outputs",
               "heads": "Patching every head"}


def _pairs(model, prompts: PatchPrompts) -> patching.PairedPrompts:
    clean, corrupt, answers, wrongs = prompts
    return patching.PairedPrompts.from_prompts(model, list(clean), list(corrupt), list(answers), list(wrongs))


def _exact_patching(kind: str, model, prompts: PatchPrompts, progress) -> pd.DataFrame:
    return _EXACT_PATCHING[kind](model, _pairs(model, prompts), progress)


_EXACT_RUNS = {kind: LongRun(text, functools.partial(_exact_patching, kind)) for kind, text in _EXACT_TEXT.items()}


def exact_patching(loaded: LoadedModel, kind: str, prompts: PatchPrompts, bar: ProgressBar) -> pd.DataFrame:
    """Exact patching of every site of ``kind`` ("resid", "attn_mlp" or "heads"), with a progress bar, kept in
    the long-run store.

    Example:
        >>> quiet = lambda text: ((lambda done, total: None), (lambda: None))
        >>> loaded = LoadedModel(model, "toy-attn-2l|sdpa")
        >>> prompts = (("The cat sat on the mat",), ("The dog sat on the mat",), (model.to_single_token(" the"),),
        ...            (model.to_single_token(" c"),))
        >>> heads = exact_patching(loaded, "heads", prompts, bar=quiet)
        >>> len(heads), has_exact_patching(loaded, "heads", prompts), has_exact_patching(loaded, "resid", prompts)
        (8, True, False)
    """
    return _EXACT_RUNS[kind](loaded, prompts, bar=bar)


def has_exact_patching(loaded: LoadedModel, kind: str, prompts: PatchPrompts) -> bool:
    """Whether ``exact_patching`` of ``kind`` on ``prompts`` is stored (returns at once, draws no bar).

    Example:
        >>> has_exact_patching(LoadedModel(model, "toy-attn-2l|sdpa"), "heads", ((), (), (), ()))
        False
    """
    return _EXACT_RUNS[kind].is_stored(loaded, prompts)
