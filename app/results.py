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
from experiments import ablation, attention, continuations, datasets, flow, induction, lens, neurons, patching, router

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


# --- Neurons and Token view pages ---
NEURON_CORPUS_RUN = "Finding every neuron's top windows in the corpus"


@st.cache_data(show_spinner="Reading the neuron …", max_entries=64, hash_funcs=_BY_MODEL_KEY)
def neuron_activation(loaded: LoadedModel, ids: tuple[int, ...], unit: neurons.MLPUnit, neuron: int) -> pd.DataFrame:
    """One MLP neuron's activation on each token of the prompt (NaN where a routed expert did not run).

    Example:
        >>> acts = neuron_activation(loaded, prompt.ids, neurons.MLPUnit(3), 17)   # doctest: +SKIP
    """
    with loaded.lock:
        return neurons.neuron_activation(loaded.model, torch.tensor([ids]), unit, neuron)


@st.cache_data(show_spinner="Projecting the neuron onto the vocabulary …", max_entries=64, hash_funcs=_BY_MODEL_KEY)
def neuron_logit_effect(loaded: LoadedModel, unit: neurons.MLPUnit, neuron: int, k: int,
                        through_final_norm: bool) -> pd.DataFrame:
    """The tokens the neuron's output weights promote and suppress most (weights only: no hook, no lock).

    Example:
        >>> effect = neuron_logit_effect(loaded, neurons.MLPUnit(3), 17, k=10, through_final_norm=True)   # doctest: +SKIP
    """
    return neurons.direct_logit_effect(loaded.model, unit, neuron, k, through_final_norm)


def neuron_corpus_maxima(loaded: LoadedModel, unit: neurons.MLPUnit, n_windows: int, window: int,
                         bar: ProgressBar) -> "neurons.CorpusMaxima":
    """Every neuron of ``unit``'s max per corpus window: from this process's store, the disk cache, or
    computed with a progress bar (then saved to disk).

    Example:
        >>> maxima = neuron_corpus_maxima(loaded, neurons.MLPUnit(3), 256, 64, bar=progress_callback)   # doctest: +SKIP
    """
    return with_progress(loaded, NEURON_CORPUS_RUN, neurons.corpus_maxima, unit, bar=bar, n_windows=n_windows,
                         window=window)


# --- Patching and Generate pages ---

# Clean texts, corrupted texts, and one answer and one wrong token id per prompt: hashable, so results cache on them.
PatchPrompts = tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...], tuple[int, ...]]
_EXACT_PATCHING = {"resid": patching.patch_residual, "attn_mlp": patching.patch_attn_mlp, "heads": patching.patch_heads}
_EXACT_TEXT = {"resid": "Patching the residual stream", "attn_mlp": "Patching attention and MLP outputs",
               "heads": "Patching every head"}


@st.cache_data(show_spinner="Generating the IOI prompts …", max_entries=16, hash_funcs=_BY_MODEL_KEY)
def ioi_prompts(loaded: LoadedModel, n: int, seed: int) -> PatchPrompts:
    """``n`` IOI prompts and their corrupted twins (``experiments.datasets.ioi_dataset``) with their answers.

    Example:
        >>> clean, corrupt, answers, wrongs = ioi_prompts(loaded, 8, seed=0)   # doctest: +SKIP
    """
    data = datasets.ioi_dataset(loaded.model, n, seed=seed)
    return (tuple(data.clean_prompts), tuple(data.corrupt_prompts), tuple(data.answer_tokens.tolist()),
            tuple(data.wrong_tokens.tolist()))


@st.cache_data(show_spinner="Attribution patching …", max_entries=16, hash_funcs=_BY_MODEL_KEY)
def attribution_patching(loaded: LoadedModel, prompts: PatchPrompts) -> pd.DataFrame:
    """Every site's attribution-patching estimate (one forward each, one backward); the unpatched metrics in attrs.

    Example:
        >>> approx = attribution_patching(loaded, prompts)   # doctest: +SKIP
        >>> approx.attrs["clean_metric"], approx.attrs["corrupt_metric"]   # doctest: +SKIP
    """
    clean, corrupt, answers, wrongs = prompts
    with loaded.lock:
        return patching.attribution_patching(loaded.model, list(clean), list(corrupt), list(answers), list(wrongs))


def _exact_patching(model, kind: str, prompts: PatchPrompts, progress) -> pd.DataFrame:
    clean, corrupt, answers, wrongs = prompts
    return _EXACT_PATCHING[kind](model, list(clean), list(corrupt), list(answers), list(wrongs), progress)


def exact_patching(loaded: LoadedModel, kind: str, prompts: PatchPrompts, bar: ProgressBar) -> pd.DataFrame:
    """Exact patching of every site of ``kind`` ("resid", "attn_mlp" or "heads"), with a progress bar.

    Example:
        >>> heads = exact_patching(loaded, "heads", prompts, bar=progress_callback)   # doctest: +SKIP
    """
    return with_progress(loaded, _EXACT_TEXT[kind], _exact_patching, kind, prompts, bar=bar)


def has_exact_patching(loaded: LoadedModel, kind: str, prompts: PatchPrompts) -> bool:
    """Whether ``exact_patching`` of ``kind`` on ``prompts`` is stored (returns at once, draws no bar).

    Example:
        >>> has_exact_patching(loaded, "heads", prompts)   # doctest: +SKIP
        False
    """
    return has_result(loaded, _EXACT_TEXT[kind], _exact_patching, kind, prompts)


@st.cache_data(show_spinner="Generating both continuations …", max_entries=32, hash_funcs=_BY_MODEL_KEY)
def continuation(loaded: LoadedModel, ids: tuple[int, ...], targets: Targets, method: str, reference: Reference,
                 max_new_tokens: int, temperature: float, top_k: Optional[int],
                 seed: int) -> "continuations.Continuations":
    """The clean continuation of the prompt beside the one with ``targets`` ablated (same settings and seed).

    Example:
        >>> result = continuation(loaded, prompt.ids, (("head", 3, 1),), "zero", None, 20, 0.0, None, 0)   # doctest: +SKIP
    """
    reference_tokens = torch.tensor(reference) if reference else None
    with loaded.lock:
        return continuations.continue_with_ablation(loaded.model, torch.tensor([ids]), targets, method, max_new_tokens,
                                                    temperature, top_k, seed, reference_tokens)


# --- Information flow page ---

FLOW_RUN = "Tracing the information flow"


def _flow_contributions(model, ids: tuple[int, ...], progress) -> "flow.FlowContributions":
    return flow.flow_contributions(model, torch.tensor([ids]), progress=progress)


def flow_contributions(loaded: LoadedModel, ids: tuple[int, ...], bar: ProgressBar) -> "flow.FlowContributions":
    """Every attention edge's, residual's and block's importance on the prompt (one forward pass, then a
    per-layer decomposition with a progress bar); kept in the long-run store, not pickled.

    Example:
        >>> contributions = flow_contributions(loaded, prompt.ids, bar=progress_callback)   # doctest: +SKIP
    """
    return with_progress(loaded, FLOW_RUN, _flow_contributions, ids, bar=bar)


@st.cache_data(show_spinner="Projecting the block onto the vocabulary …", max_entries=64, hash_funcs=_BY_MODEL_KEY)
def flow_vocab_projection(loaded: LoadedModel, ids: tuple[int, ...], layer: int, position: int, block: str,
                          k: int) -> pd.DataFrame:
    """The tokens ``block``'s output at (layer, position) promotes and suppresses most (its direct effect).

    Example:
        >>> vocab = flow_vocab_projection(loaded, prompt.ids, 3, 5, "mlp", 10)   # doctest: +SKIP
    """
    with loaded.lock:
        return flow.vocab_projection(loaded.model, torch.tensor([ids]), layer, position, block, k)
