"""The SAE comparison page (``app/pages/15_SAE_compare.py``, ``app.sae_compare``, ``app.sae_compare_figure``):
the table of SAEBench measures with their spreads, the frontier's points and error bars, the Features page's
link, and the page itself under Streamlit's AppTest on toy-attn-2l: a top-k SAE with k = 16 has L0 16 on every
token and an SAE that writes zeros is the zero ablation (KL and CE scores 0, L0 0), both by hand; hostile link
values get a clear message and a typed path is never read without its click."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

import workbench as wb
from app.results import sae_compare as compare
from app.artifact_picker import A_PATH, PICKERS
from app.sae_compare_figure import frontier_figure

PAGE = Path(__file__).resolve().parents[2] / "app" / "pages" / "15_SAE_compare.py"
SHIPPED_LABEL = "toy-attn-2l-resid1-topk (blocks.1.hook_resid_post)"


def long_table() -> pd.DataFrame:
    rows = [("a", "l0", 16.0, 0.0), ("a", "explained_variance", 0.75, 0.01), ("a", "mse", 0.5, 0.02),
            ("b", "l0", 32.0, 0.0), ("b", "explained_variance", 0.76, 0.01), ("b", "mse", 0.3, 0.02)]
    return pd.DataFrame(rows, columns=["sae", "measure", "value", "std"])


def test_the_table_puts_headline_measures_first_with_spreads_and_verdicts_against_the_first_sae():
    shown = compare.measures_table(long_table(), n_seeds=3)
    assert shown["measure"].tolist() == ["l0", "explained_variance", "mse"]
    assert shown.columns.tolist() == ["measure", "a", "b", "b vs a"]
    assert shown.loc[1, "a"] == "0.75 ± 0.01"
    # by hand: |0.76 - 0.75| = 0.01 is under 2 * sqrt((0.01^2 + 0.01^2) / 2) = 0.02; |0.3 - 0.5| = 0.2 is over 0.04
    assert shown["b vs a"].tolist() == ["differs (+16)", "within spread (+0.01)", "differs (-0.2)"]
    assert compare.measures_table(long_table(), n_seeds=1)["b vs a"].unique().tolist() == ["one seed: no spread"]


def test_frontier_points_and_figure_carry_each_saes_spreads():
    points = compare.frontier_points(long_table(), "explained_variance")
    assert points.to_dict("records")[1] == {"sae": "b", "l0": 32.0, "l0_std": 0.0, "y": 0.76, "y_std": 0.01}
    figure = frontier_figure(points, "Explained variance")
    assert [trace.name for trace in figure.data] == ["a", "b"]
    assert [list(trace.error_y.array) for trace in figure.data] == [[0.01], [0.01]]
    assert figure.layout.yaxis.title.text == "Explained variance"


def test_paths_are_checked_and_labels_made_unique():
    assert compare.parse_paths("\n /x/sae \n/x/sae\n") == ("/x/sae",)
    with pytest.raises(wb.InputError, match="at most 8 SAEs"):
        compare.parse_paths("\n".join(f"/sae/{i}" for i in range(9)))
    with pytest.raises(wb.InputError, match="characters long"):
        compare.parse_paths("/" + "a" * 2000)
    shipped = {SHIPPED_LABEL: Path("/zoo/toy-attn-2l-resid1-topk")}
    found = compare.candidates(shipped, [SHIPPED_LABEL, "not shipped"], ["/a/toy-attn-2l-resid1-topk"])
    assert [(c.label, c.source) for c in found] == [("toy-attn-2l-resid1-topk", SHIPPED_LABEL),
                                                    ("toy-attn-2l-resid1-topk #2", A_PATH)]


def test_the_features_link_names_the_pickers_choice_the_model_and_the_prompt():
    text = PICKERS["sae"]
    shipped = compare.features_link(compare.Candidate("s", "/zoo/s", SHIPPED_LABEL), "toy-attn-2l", "sdpa", "a b")
    parts = urlsplit(shipped)
    assert parts.path == "Features"
    assert parse_qs(parts.query) == {"model": ["toy-attn-2l"], "impl": ["sdpa"], text.key: [SHIPPED_LABEL],
                                     "prompt": ["a b"]}
    typed = parse_qs(urlsplit(compare.features_link(compare.Candidate("p", "/my/sae", A_PATH), "m", "eager")).query)
    assert typed[text.key] == [A_PATH] and typed[text.path_key] == ["/my/sae"]


def test_progress_runs_once_over_every_sae_and_seed():
    seen = []
    step = compare.overall_progress(lambda done, total: seen.append((done, total)), passes=3, rows_per_pass=2)
    for done in (1, 2, 1, 2, 2):  # the last pass reports its two rows at once
        step(done, 2)
    assert seen == [(1, 6), (2, 6), (3, 6), (4, 6), (6, 6)]


def test_data_follows_the_models_corpus_and_unknown_data_is_refused():
    model = wb.load_model("toy-attn-2l", progress=False)
    assert compare.default_data(model) == "stdlib-held-out"
    with pytest.raises(wb.InputError, match="data must be one of"):
        compare.bench_pool(model, "/etc", 256)


# ---- the page -------------------------------------------------------------------------------------------
def page(**query) -> AppTest:
    at = AppTest.from_file(str(PAGE), default_timeout=300)
    at.query_params["model"] = "toy-attn-2l"
    for key, value in query.items():
        at.query_params[key] = value
    return at.run()


@pytest.fixture(scope="module")
def zero_sae(tmp_path_factory) -> str:
    """An SAE at the shipped one's hook whose every weight is zero: spliced in, it is the zero ablation."""
    folder = tmp_path_factory.mktemp("zero") / "zero-sae"
    d = 128
    wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=d, d_sae=8, metadata={"hook_name": "blocks.1.hook_resid_post"}),
                        {"W_enc": torch.zeros(d, 8), "W_dec": torch.zeros(8, d), "b_enc": torch.zeros(8),
                         "b_dec": torch.zeros(d)}).save_model(folder)
    return str(folder)


def test_the_page_offers_the_shipped_sae_and_waits_for_the_button():
    at = page()
    assert not at.exception and not at.error
    assert at.multiselect(key="sae_compare_shipped").value == [SHIPPED_LABEL]
    assert any("Press “Measure the SAEs”" in info.value for info in at.info)
    assert any("Features?model=toy-attn-2l" in md.value for md in at.markdown)


def test_hostile_link_values_get_a_clear_message_and_no_path_is_read_without_a_click():
    at = page(sae_compare_seeds="NaN", sae_compare_tokens="1000000", sae_compare_hook="blocks.9.hook_evil",
              sae_compare_paths="/etc")
    assert not at.exception
    warnings = " ".join(w.value for w in at.warning)
    for key in ("sae_compare_seeds", "sae_compare_tokens", "sae_compare_hook"):
        assert key in warnings
    assert any("read only when you open them" in info.value for info in at.info)
    assert at.number_input(key="sae_compare_seeds").value == compare.DEFAULT_SEEDS
    too_many = page(sae_compare_paths="\n".join(f"/sae/{i}" for i in range(9)))
    assert not too_many.exception
    assert any("at most 8 SAEs" in error.value for error in too_many.error)


def test_the_page_measures_two_saes_with_hand_checked_values(zero_sae):
    at = page(sae_compare_paths=zero_sae, sae_compare_tokens="256", sae_compare_seeds="2")
    at.button(key="sae_compare_open").click().run()
    at.button(key="sae_compare_run").click().run()
    assert not at.exception and not at.error
    table = at.dataframe[0].value.set_index("measure")
    assert table.loc["l0", "toy-attn-2l-resid1-topk"] == "16 ± 0"   # top-k, k = 16: 16 features on every token
    for measure in ("l0", "kl_div_score", "ce_loss_score"):       # a zero SAE is the zero ablation
        assert table.loc[measure, "zero-sae"] == "0 ± 0"
    assert table.loc["l0", "zero-sae vs toy-attn-2l-resid1-topk"] == "differs (-16)"
    assert at.get("plotly_chart")
    links = " ".join(md.value for md in at.markdown)
    assert "features_sae_path=" in links and "zero-sae" in links


def test_no_sae_ticked_says_how_to_choose_one():
    at = page(sae_compare_shipped="[]")
    assert not at.exception and not at.error
    assert any("No SAE to compare: tick a shipped SAE" in info.value for info in at.info)
