"""Widgets every page shares: the page guards (errors, the open model), the prompt box with its
checks, layer and head pickers, and the progress bar of long runs.

The prompt box is a linked widget (``app.url_state``): one prompt follows the user from page to
page and lives in the page's link.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import streamlit as st
import torch

import workbench as wb
from app import hub_picker, results, state, url_state
from app.results.models import warm_model
from app.runtime import freeze_long_lived, leave_a_core_free
from app.safe_text import quoted
from app.state import LoadedModel
from app.url_state import linked

DEFAULT_PROMPT = ("When Mary and John went to the store, John gave a drink to Mary. "
                  "When Mary and John went to the store, John gave a drink to")
# Patterns cost n_layers * n_heads * P^2 floats and every label is drawn: beyond this the
# pages would be slow and unreadable, so longer prompts get a message instead.
MAX_PROMPT_TOKENS = 256
PROMPT_KEY = "prompt"  # the prompt box's key, and its query parameter in a link
LOAD_ERRORS = (wb.CheckpointError, wb.ConfigError, wb.InputError, FileNotFoundError, OSError)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """A checked prompt: its text, token ids (a tuple, so results can be cached on it) and labels.

    Example:
        >>> ids = model.to_tokens("The cat")[0]
        >>> prompt = Prompt("The cat", tuple(ids.tolist()), model.to_str_tokens(ids))
        >>> prompt.tensor.shape, prompt.str_tokens   # BOS, then the zoo's code tokenizer's pieces
        (torch.Size([1, 4]), ['<|endoftext|>', 'The', ' c', 'at'])
    """

    text: str
    ids: tuple[int, ...]
    str_tokens: list[str]

    @property
    def tensor(self) -> torch.Tensor:
        return torch.tensor([self.ids], dtype=torch.long)


def page_setup(title: str) -> None:
    """Page title and the wide layout (heatmaps need the width); call first on every page.

    Also where the dashboard applies its process settings (once, whichever page opens first), starts loading the
    session's model in the background (``app.results.models.warm_model``) and, on a page's first run, freezes what
    its imports made (``app.runtime.freeze_long_lived``: Streamlit's collection after every run stops scanning it).

    Example:
        >>> page_setup("Attention")   # doctest: +SKIP
    """
    leave_a_core_free()
    freeze_long_lived(f"page {title}")  # the page's modules are imported by now (its script's first lines)
    st.set_page_config(page_title=f"{title} · workbench", layout="wide")
    state.open_linked_model()
    # The session's model starts loading now (once per process), while the page draws its controls.
    warm_model(state.model_source(), state.attn_impl())
    linked_model_offer()


def linked_model_offer() -> None:
    """Shows the model path (or Hub repo id) a link named, with a button: it is loaded (downloaded) only when the
    user clicks.

    A link can point at any file on the server; opening it is the user's decision, not the link's.

    Example:
        >>> linked_model_offer()   # doctest: +SKIP
    """
    offer = state.linked_model_offer()
    if offer is None:
        return
    source, impl = offer
    if hub_picker.is_hub_source(source):  # a repo id: downloaded (with its progress) only on the click
        hub_picker.linked_offer(source, impl)
        return
    slot = st.empty()
    with slot.container():
        st.info(f"This link names a model path on this machine: {quoted(source, limit=300)}. It is not opened "
                "until you ask; meanwhile the pages use the model shown below.")
        clicked = st.button("Open the linked model", key="open_linked_model")
    if clicked:  # the choice replaces the offer, which goes at once
        state.choose_model(source, impl)
        slot.empty()


def guarded(body: Callable[..., None]) -> Callable[..., None]:
    """``body`` with any error turned into a message on the page instead of a traceback.

    Workbench errors (bad input, bad checkpoint, bad config) carry messages written for the
    user; anything else is logged with its traceback on the server and summarised on the page.
    Fragments need this too: a fragment's own reruns do not pass through the page's guard.

    Example:
        >>> guarded(lambda: st.write("hello"))()   # doctest: +SKIP
    """

    @functools.wraps(body)
    def run(*args, **kwargs) -> None:
        try:
            body(*args, **kwargs)
        except (wb.InputError, wb.ConfigError, wb.CheckpointError) as error:
            st.error(quoted(error, limit=600))
        except Exception as error:  # noqa: BLE001 - the page must never show a traceback
            log.exception("dashboard page failed")
            st.error(f"Something went wrong ({type(error).__name__}): {quoted(error, limit=300)}. "
                     "The server log has the details.")

    return run


def run_page(body: Callable[[], None]) -> None:
    """Runs a page's body under ``guarded``.

    Example:
        >>> run_page(lambda: st.write("hello"))   # doctest: +SKIP
    """
    guarded(body)()


def open_model() -> Optional[LoadedModel]:
    """The session's chosen model, loaded, or None after showing why it could not be loaded.

    Example:
        >>> loaded = open_model()   # doctest: +SKIP
        >>> loaded.model.cfg.n_layers if loaded else None   # doctest: +SKIP
    """
    source, impl = state.model_source(), state.attn_impl()
    if not source:
        st.error("No model chosen: pick a registered model or give a path on the Home page.")
        return None
    url_state.to_link("model", source)
    url_state.to_link("impl", impl)
    message = state.load_failure(source, impl)
    if message is None:  # not tried yet, or tried again on request: a failure is not retried on every rerun
        try:
            with st.spinner(f"Loading {quoted(source)} …"):
                return results.load_model(source, impl)
        except LOAD_ERRORS as error:
            message = f"Could not load model {quoted(source)}: {quoted(error, limit=600)}"
            state.record_load_failure(source, impl, message)
    st.error(message)
    st.info("Pick another model on the Home page (registered names are listed there).")
    if st.button("Try loading it again", key="retry_model_load"):
        state.forget_load_failure()
        st.rerun()
    return None


def require_model() -> LoadedModel:
    """The open model; stops the page (after an explanation) when there is none.

    Example:
        >>> model = require_model().model   # doctest: +SKIP
    """
    loaded = open_model()
    if loaded is None:
        st.stop()
    return loaded


def prompt_box(loaded: LoadedModel, label: str = "Prompt", max_tokens: int = MAX_PROMPT_TOKENS) -> Optional[Prompt]:
    """A text box for the prompt; returns the checked prompt, or None after saying what is wrong.

    Checks: not empty, tokenizable by this model, no longer than the model's context and no
    longer than ``max_tokens`` (what the dashboard can draw quickly).

    Example:
        >>> prompt = prompt_box(require_model())   # doctest: +SKIP
    """
    text = linked(st.text_area, label, value=DEFAULT_PROMPT, key=PROMPT_KEY, height=90,
                  help="Shared by every page and kept in the page's link. Press Ctrl+Enter (or click outside "
                       "the box) to apply.")
    if not text.strip():
        st.warning("The prompt is empty: type some text to analyse.")
        return None
    model = loaded.model
    try:
        tokens = model.to_tokens(text)
    except wb.InputError as error:
        st.error(f"This prompt cannot be tokenized by the model: {quoted(error, limit=300)}")
        return None
    n_tokens, n_ctx = tokens.shape[1], model.cfg.n_ctx
    if n_tokens > n_ctx:
        st.error(f"The prompt is {n_tokens} tokens long, longer than the model's context of {n_ctx} tokens. "
                 "Shorten it.")
        return None
    if n_tokens > max_tokens:
        st.error(f"The prompt is {n_tokens} tokens long; the dashboard draws prompts of up to {max_tokens} "
                 "tokens. Shorten it (the `python -m experiments.*` commands take longer prompts).")
        return None
    prompt = Prompt(text, tuple(int(i) for i in tokens[0].tolist()), model.to_str_tokens(tokens[0]))
    with st.container(key="prompt_tokens"):  # the key lets the browser test see the tokens change
        shown = " | ".join(quoted(repr(t)) for t in prompt.str_tokens[:120]) + (" | …" if n_tokens > 120 else "")
        st.caption(f"{n_tokens} tokens: {shown}")
    return prompt


def single_token(model, text: str, what: str) -> int:
    """The id of ``text`` when it is one token of the vocabulary; stops the page with its pieces otherwise (the
    answer and wrong tokens of a logit difference).

    Example:
        >>> answer = single_token(loaded.model, " Mary", "answer")   # doctest: +SKIP
    """
    try:
        return model.to_single_token(text)
    except wb.InputError as error:
        st.error(f"The {what} token {quoted(text)} is not one token of this model's vocabulary ({quoted(error)}). Give a single "
                 "token, minding the leading space (e.g. “ Mary”).")
        st.stop()


def checked_length(model, text: str, what: str) -> Optional[int]:
    """The token length of ``text``, or None after saying it is too long to draw (one prompt of a pair).

    Example:
        >>> n_tokens = checked_length(loaded.model, "When Mary and John", "clean")   # doctest: +SKIP
    """
    n_tokens, limit = model.to_tokens(text).shape[1], min(MAX_PROMPT_TOKENS, model.cfg.n_ctx)
    if n_tokens > limit:
        st.error(f"The {what} prompt is {n_tokens} tokens long; this page draws prompts of up to {limit} tokens.")
        return None
    return n_tokens


DEFAULT_CLEAN = "When Mary and John went to the store, John gave a drink to"
DEFAULT_CORRUPT = "When Mary and John went to the store, Mary gave a drink to"


@dataclass(frozen=True)
class PromptPair:
    """A typed clean/corrupted pair, its answer and wrong token ids and the two prompts' token lengths."""

    clean: str
    corrupt: str
    answer: int
    wrong: int
    lengths: tuple[int, int]


def prompt_pair(model, prefix: str) -> Optional[PromptPair]:
    """A clean and a corrupted prompt with answer and wrong tokens (widget keys ``{prefix}_clean`` etc., linked),
    checked; None after saying what is wrong.

    Example:
        >>> pair = prompt_pair(loaded.model, "patching")   # doctest: +SKIP
    """
    left, right = st.columns(2)
    with left:
        clean = linked(st.text_area, "Clean prompt", value=DEFAULT_CLEAN, key=f"{prefix}_clean", height=80)
        answer = linked(st.text_input, "Answer token (right on the clean prompt)", value=" Mary",
                        key=f"{prefix}_answer")
    with right:
        corrupt = linked(st.text_area, "Corrupted prompt", value=DEFAULT_CORRUPT, key=f"{prefix}_corrupt", height=80)
        wrong = linked(st.text_input, "Wrong token (what the corrupted prompt points to)", value=" John",
                       key=f"{prefix}_wrong")
    if not clean.strip() or not corrupt.strip():
        st.warning("Both prompts are needed: type a clean and a corrupted prompt.")
        return None
    lengths = (checked_length(model, clean, "clean"), checked_length(model, corrupt, "corrupted"))
    if None in lengths:
        return None
    return PromptPair(clean, corrupt, single_token(model, answer, "answer"), single_token(model, wrong, "wrong"),
                      lengths)


def click_keeper(chart_key: str, store_key: str, kind: type) -> Callable[[], None]:
    """An ``on_select`` callback for the chart drawn with ``key=chart_key``: keeps the clicked point's ``customdata``
    (when of type ``kind``) in ``st.session_state[store_key]``, for the page to apply on its next run.

    Example:
        >>> remember = click_keeper("circuits_graph", "_circuits_clicked", str)   # doctest: +SKIP
    """
    def remember() -> None:
        event = st.session_state.get(f"{chart_key}_chart") or {}
        points = (event.get("selection") or {}).get("points") or []
        picked = points[0].get("customdata") if points else None
        picked = picked[0] if isinstance(picked, list) and picked else picked
        if isinstance(picked, kind):
            st.session_state[store_key] = picked
    return remember


def layer_picker(loaded: LoadedModel, label: str = "Layer", key: Optional[str] = None) -> int:
    """A layer number in 0..n_layers-1 (a slider; a select box for a one-layer model).

    Example:
        >>> layer = layer_picker(loaded, key="attention_layer")   # doctest: +SKIP
    """
    n_layers = loaded.model.cfg.n_layers
    if n_layers == 1:
        return linked(st.selectbox, label, options=[0], key=key)
    return linked(st.slider, label, min_value=0, max_value=n_layers - 1, value=0, key=key)


def head_picker(loaded: LoadedModel, label: str, key: str, default: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """A (layer, head) pair from two select boxes side by side.

    Example:
        >>> layer, head = head_picker(loaded, "First head", key="left")   # doctest: +SKIP
    """
    cfg = loaded.model.cfg
    left, right = st.columns(2)
    with left:
        layer = linked(st.selectbox, f"{label}: layer", options=range(cfg.n_layers),
                       index=min(default[0], cfg.n_layers - 1), key=f"{key}_layer")
    with right:
        head = linked(st.selectbox, f"{label}: head", options=range(cfg.n_heads),
                      index=min(default[1], cfg.n_heads - 1), key=f"{key}_head")
    return int(layer), int(head)


def progress_callback(text: str) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A ``(done, total)`` callback driving a fresh ``st.progress`` bar, and a function that removes the bar.

    The ``bar`` that pages hand to the results layer's long runs (``results.head_sweep(..., bar=progress_callback)``).

    Example (on a page: it draws a bar):
        >>> report, finish = progress_callback("Sweeping heads")   # doctest: +SKIP
        >>> sweep = ablation.head_sweep(model, tokens, progress=report); finish()   # doctest: +SKIP
    """
    slot = st.empty()
    bar = slot.progress(0.0, text=text)

    def report(done: int, total: int) -> None:
        bar.progress(min(1.0, done / max(total, 1)), text=f"{text}: {done}/{total}")

    return report, slot.empty
