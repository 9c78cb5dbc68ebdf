"""The ablation choice shared by the Ablation, Generate and Token view pages: what to knock out,
how, and the reference text mean and resample ablation read.

Every widget is linked (``app.url_state``): the choice follows the user from page to page and
lives in the URL, so the Generate page continues with exactly the ablation set on the Ablation page.

No picker offers Streamlit's "Select all": it is the first entry of an open list, so a second Enter in the box
picked it (all 270 of SmolLM2's heads) and the ablation ran at once. Enter on an empty box picks the list's first
entry, so the head picker's first entry is ``NO_HEAD``: a change that picks it keeps only the heads chosen before
(Enter pressed twice, faster than the page redraws, picks ``NO_HEAD`` and then the next head: both go), so Enter
adds no head and starts no new run.

Legend: H n_heads, L n_layers.
"""

from __future__ import annotations

import streamlit as st

from app.safe_text import quoted
from app.results import Reference, Targets
from app.state import LoadedModel
from app.url_state import choose, linked
from app.widgets import Prompt
from experiments import ablation

KIND_LABELS = {"head": "Heads", "attn_layer": "Attention layers", "mlp_layer": "MLP layers",
               "neuron": "MLP neurons", "expert": "Experts"}
NO_HEAD = (-1, -1)  # the head list's first entry: what Enter on an empty box picks, dropped at once
HEADS_KEY = "ablation_heads"
_HEADS_BEFORE = "_ablation_heads_before"  # the heads of the last finished run: what a change through NO_HEAD keeps
# Mean and resample ablation replace activations by those of other text; these are the default.
DEFAULT_REFERENCES = "\n".join([
    "The history of the region goes back thousands of years, and the first written records describe farmers, "
    "traders and travellers who crossed the river valley on their way to the coast, where markets grew into towns.",
    "To install the package, open a terminal, create a new virtual environment, activate it and run the install "
    "command; then import the module in Python and call the main function with the path to your data file.",
    "She opened the letter slowly, read the first line twice, and then looked out of the window at the rain that "
    "had been falling since the morning, wondering whether he would ever come back to the little house by the sea.",
])


def _head_label(head: tuple[int, int]) -> str:
    return "(Enter adds no head: type one, e.g. L3H4)" if head == NO_HEAD else f"L{head[0]}H{head[1]}"


def _drop_no_head() -> None:
    """The head picker's change callback: a change that picked ``NO_HEAD`` is undone (the heads chosen before stay,
    nothing it added does)."""
    chosen = st.session_state.get(HEADS_KEY, [])
    if NO_HEAD in chosen:
        before = st.session_state.get(_HEADS_BEFORE, [])
        chosen = [head for head in chosen if head in before]
    st.session_state[HEADS_KEY] = chosen
    choose(HEADS_KEY, chosen)


def choose_targets(loaded: LoadedModel) -> Targets:
    """What to ablate: one kind at a time (heads, attention or MLP layers, neurons, experts), any number of it.

    Example:
        >>> targets = choose_targets(require_model())   # doctest: +SKIP
        >>> targets                                      # doctest: +SKIP
        (('head', 29, 0),)
    """
    cfg = loaded.model.cfg
    kinds = ["head", "attn_layer"]
    if not cfg.attn_only:
        kinds += ["mlp_layer", "expert" if cfg.is_moe else "neuron"]
    kind = linked(st.radio, "Ablate", options=kinds, format_func=KIND_LABELS.get, horizontal=True, key="ablation_kind")
    layers = list(range(cfg.n_layers))
    if kind == "head":
        options = [(l, h) for l in layers for h in range(cfg.n_heads)]
        chosen = linked(st.multiselect, "Heads", options=[NO_HEAD, *options], default=[options[-cfg.n_heads]],
                        key=HEADS_KEY, format_func=_head_label, select_all=False, on_change=_drop_no_head,
                        placeholder="Type a head, e.g. L3H4")
        chosen = [head for head in chosen if head != NO_HEAD]  # a link may name it too
        st.session_state[_HEADS_BEFORE] = chosen
        return tuple(("head", l, h) for l, h in chosen)
    if kind in ("attn_layer", "mlp_layer"):
        chosen = linked(st.multiselect, "Layers", options=layers, default=[0], key=f"ablation_{kind}s",
                         select_all=False)
        return tuple((kind, l, None) for l in chosen)
    if kind == "expert":  # only the layers with experts, each with its own count
        layer = linked(st.selectbox, "Layer", options=cfg.moe_layers, key="ablation_unit_layer")
        n_experts = cfg.layer_values("num_experts")[layer]
        chosen = linked(st.multiselect, "Experts", options=list(range(n_experts)), default=[0], key="ablation_experts",
                         select_all=False)
        return tuple(("expert", layer, e) for e in chosen if e < n_experts)
    layer = linked(st.selectbox, "Layer", options=layers, key="ablation_unit_layer")
    d_mlp = cfg.layer_values("d_mlp")[layer]
    text = linked(st.text_input, f"Neurons (0..{d_mlp - 1}, comma separated)", value="0, 1, 2", key="ablation_neurons")
    try:
        neurons = sorted({int(part) for part in text.replace(" ", "").split(",") if part})
    except ValueError:
        st.error(f"Neurons must be whole numbers separated by commas, got {quoted(text)}.")
        return ()
    outside = [n for n in neurons if not 0 <= n < d_mlp]
    if outside:
        st.error(f"Layer {layer} has neurons 0..{d_mlp - 1}; {outside} are outside that range.")
        return ()
    return tuple(("neuron", layer, n) for n in neurons)


def choose_method(targets: Targets) -> str:
    """Zero, mean or resample ablation (experts: zero only, their router weight is dropped).

    Example:
        >>> method = choose_method(targets)   # doctest: +SKIP
    """
    experts = any(kind == "expert" for kind, _, _ in targets)
    return linked(st.radio, "Method", options=["zero"] if experts else list(ablation.METHODS), horizontal=True,
                  key="ablation_method", help="Experts support zero ablation (their router weight is dropped).")


def reference_rows(loaded: LoadedModel, prompt: Prompt, method: str, length: int | None = None) -> Reference:
    """Token ids of the reference prompts, each cut to ``length`` tokens (the prompt's length by default;
    None for zero ablation). Stops the page with a message when no line is long enough.

    Example:
        >>> reference = reference_rows(loaded, prompt, "mean")   # doctest: +SKIP
    """
    if method == "zero":
        return None
    text = linked(st.text_area, "Reference text for mean / resample (one prompt per line)", value=DEFAULT_REFERENCES,
                  key="ablation_reference", height=110,
                  help="Mean: each activation is replaced by its mean over these prompts at the same position. "
                       "Resample: by its value on one of them. Lines shorter than the prompt are skipped.")
    n = length or len(prompt.ids)
    rows = [tuple(loaded.model.to_tokens(line)[0, :n].tolist()) for line in text.splitlines() if line.strip()]
    rows = [row for row in rows if len(row) == n]
    if not rows:
        st.error(f"Mean and resample ablation need at least one reference line of {n} tokens or more.")
        st.stop()
    return tuple(rows)
