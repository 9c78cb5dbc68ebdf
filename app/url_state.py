"""A page's state in the URL: every linked widget is seeded from the query parameter of its key and
writes its value back, so a copied link reopens the same view (model, prompt, layer, head, ablation ...).

A linked widget also keeps its value in a plain session-state key: Streamlit forgets a widget's
value when the user moves to a page that does not draw it, and widgets with one key on two pages
are two widgets; the plain key carries the choice across pages (the prompt follows the user, and
the Ablation page's choice reaches the Generate page).

Values go into the URL as text: strings as they are, anything else as JSON (tuples as lists). A
value from a link that does not fit the widget here (a layer the model does not have, an option
that does not exist, a number out of range, NaN or infinite) is dropped with a warning, and the widget starts at
its default.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Optional

import streamlit as st

from app.safe_text import quoted

_SAVED = "_linked_{}"
# Set by ``follow``: the URL's value of the key was chosen for another prompt, so the widget's next draw ignores it
# and starts at its default; the draw then writes its value back. (Popping the parameter instead sent the browser
# a URL update to remove it and another to put the same default back, 3 ms of its main thread each.)
_STALE_LINK = "_stale_link_{}"
# The keyword that carries each widget's default, which must be dropped when the value comes from
# session state (Streamlit warns when a widget gets both).
_DEFAULT_KWARG = {"selectbox": "index", "radio": "index", "multiselect": "default", "pills": "default",
                  "segmented_control": "default"}
_CHOICE = ("selectbox", "radio", "pills", "segmented_control", "select_slider")


def encode(value: Any) -> str:
    """``value`` as URL text: a string as it is, anything else as JSON (tuples become lists).

    Example:
        >>> encode("The cat"), encode(3), encode([(1, 2)])
        ('The cat', '3', '[[1, 2]]')
    """
    return value if isinstance(value, str) else json.dumps(_plain(value))


def _plain(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    return value


def _options(args: tuple, kwargs: dict) -> Optional[list]:
    options = kwargs.get("options", args[0] if args else None)
    return None if options is None else list(options)


def _number(raw: str, like: Any) -> Any:
    value = json.loads(raw)
    if isinstance(value, list):
        return tuple(_number(json.dumps(v), like[0] if isinstance(like, (tuple, list)) else like) for v in value)
    if isinstance(like, bool) or not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(raw)
    if not math.isfinite(value):  # NaN passes every bound check (each comparison is False): never a widget's value
        raise ValueError(f"{raw} is not a finite number")
    return int(value) if isinstance(like, int) and float(value).is_integer() else float(value)


def decode(kind: str, raw: str, args: tuple, kwargs: dict) -> Any:
    """The widget value URL text ``raw`` stands for, checked against the widget's options or bounds.

    Raises ValueError when it does not fit (an unknown option, a number out of range or not finite, bad JSON).

    Example:
        >>> decode("selectbox", "2", (), {"options": [0, 1, 2]})
        2
        >>> decode("number_input", "NaN", (), {"min_value": 0.0, "max_value": 1.0})
        Traceback (most recent call last):
        ValueError: NaN is not a finite number
        >>> decode("multiselect", "[[0, 1]]", (), {"options": [(0, 0), (0, 1)]})
        [(0, 1)]
    """
    if kind in _CHOICE or kind == "multiselect":
        options = _options(args, kwargs)
        by_text = {encode(option): option for option in options}
        if kind == "multiselect":
            return [by_text[encode(item)] for item in json.loads(raw)]  # KeyError: not an option
        return by_text[raw]
    if kind in ("text_input", "text_area"):
        return raw
    if kind in ("checkbox", "toggle"):
        value = json.loads(raw)
        if not isinstance(value, bool):
            raise ValueError(raw)
        return value
    if kind in ("slider", "number_input"):
        low = kwargs.get("min_value", args[0] if args else None)
        high = kwargs.get("max_value", args[1] if len(args) > 1 else None)
        like = kwargs.get("value", low if low is not None else 0.0)
        value = _number(raw, like)
        for v in value if isinstance(value, tuple) else (value,):
            if (low is not None and v < low) or (high is not None and v > high):
                raise ValueError(f"{v} outside {low}..{high}")
        return value
    raise ValueError(f"widgets of kind {kind!r} cannot be linked")


def _seed(kind: str, key: str, args: tuple, kwargs: dict) -> bool:
    """Puts this session's saved value of ``key`` (else the link's) into session state; True when it did."""
    saved_key = _SAVED.format(key)
    stale_link = st.session_state.pop(_STALE_LINK.format(key), False)
    if saved_key in st.session_state:
        candidates = [("saved", st.session_state[saved_key])]
    else:
        candidates = [("link", st.query_params[key])] if key in st.query_params and not stale_link else []
    for origin, value in candidates:
        raw = value if origin == "link" else encode(value)
        try:
            st.session_state[key] = decode(kind, raw, args, kwargs)
            return True
        except (KeyError, ValueError, TypeError, json.JSONDecodeError):
            if origin == "link":
                st.warning(f"The link's value for {quoted(key)} ({quoted(raw, limit=60)}) does not fit here; "
                           "using the default.")
    if candidates:  # the widget's own value came from other options (a longer prompt, another model): drop it too
        st.session_state.pop(key, None)
    return False


def _saver(key: str, on_change: Optional[Callable[..., Any]]) -> Callable[..., None]:
    """A change callback that saves the widget's new value before the script reruns, then calls ``on_change``."""
    def save(*args: Any, **kwargs: Any) -> None:
        st.session_state[_SAVED.format(key)] = st.session_state[key]
        if on_change is not None:
            on_change(*args, **kwargs)
    return save


def linked(widget: Callable[..., Any], label: str, *args: Any, key: str, in_form: bool = False, **kwargs: Any) -> Any:
    """``widget(label, *args, key=key, **kwargs)`` whose value lives in the URL and follows the user across pages.

    ``widget`` is a Streamlit input (``st.selectbox``, ``st.radio``, ``st.multiselect``, ``st.pills``,
    ``st.segmented_control``, ``st.slider``, ``st.number_input``, ``st.text_input``, ``st.text_area``,
    ``st.checkbox``, ``st.toggle``); pass its options, bounds and default as keyword arguments. The value
    comes from this session's last value of ``key`` (on any page), else from the URL's query parameter
    ``key``, else the default; it is written back to both after drawing.

    The saved value is put back before every draw (Streamlit drops a widget's value on pages that do not
    draw it), so a change is saved by the widget's change callback first. Widgets inside a form cannot
    have one: pass ``in_form=True`` and the value is only restored when Streamlit has none.

    Example:
        >>> layer = linked(st.selectbox, "Layer", options=range(30), index=0, key="attention_layer")   # doctest: +SKIP
        >>> # the page's URL now ends in ?attention_layer=0; opening ?attention_layer=5 starts at layer 5
    """
    kind = getattr(widget, "__name__", "")
    if (not in_form or key not in st.session_state) and _seed(kind, key, args, kwargs):
        kwargs.pop(_DEFAULT_KWARG.get(kind, "value"), None)
    if not in_form:
        kwargs["on_change"] = _saver(key, kwargs.get("on_change"))
    value = widget(label, *args, key=key, **kwargs)
    st.session_state[_SAVED.format(key)] = value
    to_link(key, value)
    return value


def to_link(key: str, value: Any) -> None:
    """Writes ``value`` to the URL's query parameter ``key`` (removes it when None).

    Example:
        >>> to_link("model", "toy-moe-2l")   # doctest: +SKIP
    """
    if value is None:
        st.query_params.pop(key, None)
    elif st.query_params.get(key) != encode(value):
        st.query_params[key] = encode(value)


def choose(key: str, value: Any) -> None:
    """Moves the linked widget ``key`` to ``value``: call it before the widget is drawn in this run
    (e.g. when a click on a chart picks a head, or a node, that a select box shows).

    Example:
        >>> choose("patching_head", (9, 6))   # doctest: +SKIP
    """
    st.session_state[_SAVED.format(key)] = value


def follow(basis_name: str, basis: Any, *keys: str) -> bool:
    """Resets the linked widgets ``keys`` to their defaults when ``basis`` (a prompt's ids, a model's key) differs
    from the one they were last chosen for in this session; True when it did. Call it before drawing them.

    A range or a selection made for one prompt rarely makes sense for the next (the grid's layers, the inspected
    edge, the traced token): the new prompt's default replaces it, this session's value and the link's alike. The
    first run of a session resets nothing, so a link opens on exactly the view it names.

    Example:
        >>> follow("attention_grid", prompt.ids, "attention_grid_layers")   # doctest: +SKIP
        False
    """
    marker = f"_follows_{basis_name}"
    previous = st.session_state.get(marker)
    st.session_state[marker] = basis
    if previous is None or previous == basis:
        return False
    for key in keys:
        st.session_state.pop(_SAVED.format(key), None)
        st.session_state.pop(key, None)
        st.session_state[_STALE_LINK.format(key)] = True
    return True
