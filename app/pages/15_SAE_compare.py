"""SAE compare: several SAEs of the open model at one hook, measured with SAEBench 0.6's core measures
(``experiments.sae.bench``) over seeds: the measures as a table with their spreads (and whether each SAE differs
from the first beyond them), the L0 against explained-variance / loss-recovered frontier, and a link that opens
each SAE on the Features page. The shipped SAEs are offered first; SAE directories typed in (a link may fill them
in) are read only after a click. The run waits for its button; every seed's result is cached on disk.
"""

from __future__ import annotations

import streamlit as st

from app import downloads
from app.results import sae_compare as compare
from app.results.artifacts import artifact_choices, load_artifact
from app.safe_text import quoted
from app.sae_compare_figure import frontier_figure
from app.state import LoadedModel, attn_impl, model_source
from app.url_state import linked
from app.widgets import LOAD_ERRORS, PROMPT_KEY, page_setup, progress_callback, require_model, run_page

_OPENED = "_sae_compare_opened"  # the typed paths this session chose to read (a link can fill them, not open them)


def _choose(loaded: LoadedModel) -> list[compare.Candidate]:
    """The shipped SAEs ticked (all of them by default) and the typed directories this session opened."""
    shipped = artifact_choices(loaded, "sae")
    chosen = linked(st.multiselect, "Shipped SAEs", options=list(shipped), default=list(shipped),
                    key="sae_compare_shipped", help="The SAEs shipped for this model (wb.shipped).")
    typed = linked(st.text_area, "More SAE directories (one per line)", value="", key="sae_compare_paths",
                   height=80, placeholder="/path/to/sae (cfg.json + sae_weights.safetensors)",
                   help="Directories in SAELens's format. They are read only when you press “Open these SAEs”.")
    paths = compare.parse_paths(typed)
    if paths and st.session_state.get(_OPENED) != paths:
        listed = ", ".join(quoted(p, limit=200) for p in paths)
        st.info(f"The SAE directories {listed} are read only when you open them.")
        if st.button("Open these SAEs", key="sae_compare_open"):
            st.session_state[_OPENED] = paths
        else:
            paths = ()
    found = compare.candidates(shipped, chosen, paths)
    if len(found) > compare.MAX_SAES:
        st.error(f"{len(found)} SAEs chosen; the page compares at most {compare.MAX_SAES}.")
        return []
    return found


def _open(loaded: LoadedModel, found: list[compare.Candidate]) -> list[compare.Compared]:
    opened = []
    for candidate in found:
        try:
            held = load_artifact(loaded, "sae", candidate.path)
        except LOAD_ERRORS as error:
            st.error(f"Could not load the SAE {quoted(candidate.label)} at {quoted(candidate.path, limit=300)}: "
                     f"{quoted(error, limit=400)}")
            continue
        opened.append(compare.Compared(candidate, held.key, held.artifact))
    return opened


def _at_one_hook(opened: list[compare.Compared]) -> list[compare.Compared]:
    """The SAEs at the hook chosen (the first SAE's by default); the others are named as left out."""
    groups = compare.by_hook(opened)
    hook = linked(st.selectbox, "Hook", options=list(groups), index=0, key="sae_compare_hook",
                  help="SAEs are compared at one hook: the model's activations there are what they reconstruct.")
    others = [item.candidate.label for name, items in groups.items() if name != hook for item in items]
    if others:
        st.caption(f"Left out (another hook): {', '.join(quoted(label) for label in others)}.")
    return groups[hook]


def _settings(loaded: LoadedModel) -> tuple[str, int, int]:
    cols = st.columns(3)
    with cols[0]:
        default = compare.default_data(loaded.model)
        data = linked(st.selectbox, "Data", options=list(compare.DATA_CHOICES),
                      index=compare.DATA_CHOICES.index(default), key="sae_compare_data",
                      help="Held-out text: the Python standard library's (the zoo models' corpus) or English prose "
                           "(Debian's fortunes and handbook). Each seed draws its rows from a pool of it.")
    with cols[1]:
        n_tokens = linked(st.select_slider, "Tokens per seed", options=list(compare.TOKEN_COUNTS),
                          value=compare.DEFAULT_TOKENS, key="sae_compare_tokens")
    with cols[2]:
        n_seeds = linked(st.number_input, "Seeds", min_value=1, max_value=compare.MAX_SEEDS,
                         value=compare.DEFAULT_SEEDS, step=1, key="sae_compare_seeds",
                         help="Each seed evaluates its own sample of the data: the spread over seeds says how much "
                              "of a difference is noise.")
    return data, int(n_tokens), int(n_seeds)


def _links(compared: list[compare.Compared]) -> None:
    prompt = st.session_state.get(f"_linked_{PROMPT_KEY}") or st.query_params.get(PROMPT_KEY)
    with st.container(key="sae_compare_links"):
        st.markdown("**Open an SAE's features**")
        for item in compared:
            link = compare.features_link(item.candidate, model_source(), attn_impl(), prompt)
            cfg = item.sae.cfg
            # the label in a code span: a folder's name draws no markdown of its own, even inside link text
            st.markdown(f"- [{quoted(item.candidate.label)}]({link}): {quoted(cfg.architecture())}, "
                        f"{cfg.d_sae} features")


def main() -> None:
    st.title("SAE compare")
    loaded = require_model()
    found = _choose(loaded)
    if not found:
        shipped = "" if artifact_choices(loaded, "sae") else " (this model ships none)"
        st.info(f"No SAE to compare{shipped}: tick a shipped SAE or type the directories of SAEs trained on this "
                "model above.")
        return
    opened = _open(loaded, found)
    if not opened:
        return
    chosen = _at_one_hook(opened)
    data, n_tokens, n_seeds = _settings(loaded)
    pressed = st.button("Measure the SAEs", key="sae_compare_run", type="primary",
                        help="SAEBench's core measures: per seed, the clean model, the SAE spliced in and the hook "
                             "zero-ablated on the seed's tokens. Cached on disk: a second run is immediate.")
    if not (pressed or compare.is_measured(loaded, chosen, data, n_tokens, n_seeds)):
        st.info("Press “Measure the SAEs” to run SAEBench's core measures on each of them.")
        _links(chosen)
        return
    table = compare.compare(loaded, chosen, data, n_tokens, n_seeds, bar=progress_callback)
    st.subheader("SAEBench core measures (mean ± standard deviation over seeds)")
    st.caption(f"{n_seeds} seed(s) of {n_tokens} tokens of {quoted(data)}, special tokens left out; "
               "“differs” means beyond twice the pooled standard deviation.")
    downloads.table(compare.measures_table(table, n_seeds), "sae_compare_measures", key="sae_compare_table")
    with st.expander("Every seed's value (long table)"):
        downloads.table(table, "sae_compare_long", key="sae_compare_long")
    y_label = linked(st.radio, "Frontier against", options=list(compare.FRONTIER_Y), horizontal=True,
                     key="sae_compare_y")
    points = compare.frontier_points(table, compare.FRONTIER_Y[y_label])
    downloads.figure(frontier_figure(points, y_label), "sae_compare_frontier", key="sae_compare_frontier")
    _links(chosen)


page_setup("SAE compare")
run_page(main)
