"""The one picker of a dictionary (an SAE, a transcoder set) for the open model: the artifacts shipped for it
(``wb.shipped``, through ``app.results.artifacts``) first, then "a path on this machine", which a link may fill
in but only a click opens (a link must not make the dashboard read any path it names).

Each kind's labels, widget keys and messages are a row of ``PICKERS``: pages, links and the browser tests name
them, so they are kept exactly as the pages had them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import streamlit as st

from app.results.artifacts import LoadedArtifact, artifact_choices, load_artifact
from app.safe_text import quoted
from app.state import LoadedModel
from app.url_state import linked
from app.widgets import LOAD_ERRORS

A_PATH = "A path on this machine"


@dataclass(frozen=True)
class PickerText:
    """What one kind's picker says and the keys its widgets (and links) use."""

    label: str          # the select box's label
    key: str            # its key (and URL parameter)
    help: str
    path_label: str     # the text box for a path
    path_key: str
    placeholder: str
    enter_info: str     # shown while the path is empty
    unread_info: str    # shown before the click that reads a path; {path} is the quoted path
    open_label: str     # the button that reads it
    open_key: str
    opened_state: str   # the session key remembering the path this session chose to open
    what: str           # "the SAE", "the transcoders": in the load error


PICKERS: dict[str, PickerText] = {
    "sae": PickerText(
        "SAE", "features_sae_source",
        "SAEs shipped for this model, or any directory in SAELens's format (cfg.json and sae_weights.safetensors).",
        "SAE directory", "features_sae_path", "/path/to/sae (cfg.json + sae_weights.safetensors)",
        "Enter the directory of an SAE trained on this model (SAELens's format: `cfg.json` and "
        "`sae_weights.safetensors`; `wb.SAE.save` writes it).",
        "The SAE directory {path} is read only when you open it.", "Open this SAE", "features_open_sae",
        "_features_sae_opened", "the SAE"),
    "transcoders": PickerText(
        "Transcoders", "attribution_tc_source",
        "Transcoder sets shipped for this model, or a path in circuit-tracer's formats (a config.yaml with "
        "per-layer files, a cross-layer transcoder's folder), SAELens transcoder directories or a folder written "
        "by TranscoderSet.save.",
        "Transcoder path", "attribution_tc_path", "/path/to/transcoders (config.yaml or a folder)",
        "Enter the path of transcoders for this model (`wb.load_transcoders` reads circuit-tracer's formats, "
        "SAELens transcoders and `TranscoderSet.save` folders).",
        "The transcoders at {path} are read only when you open them.", "Open these transcoders",
        "attribution_open_tc", "_attribution_tc_opened", "the transcoders"),
}


@dataclass(frozen=True)
class Pick:
    """What the picker's choices come to: ``path`` to open (None until there is one) and the ``step`` the page
    is at: "shipped" (a shipped artifact), "enter" (waiting for a path), "confirm" (a path not yet opened by a
    click), "open" (a path this session opened)."""

    path: Optional[str]
    step: str


def picked_path(choices: Mapping[str, Path], source: str, typed: str, opened: Optional[str]) -> Pick:
    """The picker's decision, as a function: a shipped ``source`` opens its folder; "a path on this machine"
    opens ``typed`` only once this session ``opened`` exactly that path (a link may set ``typed``, never open it).

    Example:
        >>> choices = {"resid0 (blocks.0.hook_resid_post)": Path("/zoo/m/saes/resid0")}
        >>> picked_path(choices, "resid0 (blocks.0.hook_resid_post)", "", None)
        Pick(path='/zoo/m/saes/resid0', step='shipped')
        >>> picked_path(choices, A_PATH, "  ", None), picked_path(choices, A_PATH, "/x", None)
        (Pick(path=None, step='enter'), Pick(path=None, step='confirm'))
        >>> picked_path(choices, A_PATH, " /x ", "/x")
        Pick(path='/x', step='open')
    """
    if source != A_PATH and source in choices:
        return Pick(str(choices[source]), "shipped")
    path = (typed or "").strip()
    if not path:
        return Pick(None, "enter")
    return Pick(path, "open") if opened == path else Pick(None, "confirm")


def pick_artifact(loaded: LoadedModel, kind: str) -> Optional[str]:
    """The picker: a select box of the shipped ``kind`` artifacts and "a path on this machine", with its text box
    and the button that opens a path; returns the path to open, or None after saying what is missing.

    Example:
        >>> pick_artifact(loaded, "sae")   # doctest: +SKIP
        '.../workbench/zoo/toy-attn-2l/saes/toy-attn-2l-resid1-topk'
    """
    text = PICKERS[kind]
    choices = artifact_choices(loaded, kind)
    source = linked(st.selectbox, text.label, options=[*choices, A_PATH], index=0, key=text.key, help=text.help)
    typed = ""
    if source == A_PATH:
        typed = linked(st.text_input, text.path_label, value="", key=text.path_key, placeholder=text.placeholder)
    pick = picked_path(choices, source, typed, st.session_state.get(text.opened_state))
    if pick.step == "enter":
        st.info(text.enter_info)
    elif pick.step == "confirm":
        st.info(text.unread_info.format(path=quoted(typed.strip(), limit=300)))
        if not st.button(text.open_label, key=text.open_key):
            return None
        st.session_state[text.opened_state] = typed.strip()
        return typed.strip()
    return pick.path


def open_artifact(loaded: LoadedModel, kind: str) -> Optional[LoadedArtifact]:
    """The picked artifact loaded (``app.results.artifacts.load_artifact``), or None after the picker's message
    or the quoted load error.

    Example:
        >>> open_artifact(loaded, "transcoders")   # doctest: +SKIP
    """
    path = pick_artifact(loaded, kind)
    if path is None:
        return None
    try:
        return load_artifact(loaded, kind, path)
    except LOAD_ERRORS as error:
        st.error(f"Could not load {PICKERS[kind].what} at {quoted(path, limit=300)}: {quoted(error, limit=400)}")
        return None

