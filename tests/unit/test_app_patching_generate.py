"""The Patching and Generate pages under Streamlit's AppTest, on the toy dense (attention-only) model, the
toy mixture of experts and a tiny model whose tokenizer knows the IOI names; and the experiments pieces
the Patching page adds (attribution agreement, clickable heads map, the unpatched metrics).

Every number the pages show is checked against a hand calculation here: logits of ``model(tokens)``,
a head patched or zeroed by a hook written in this file, a greedy loop of argmax over ``model(tokens)``.
"""

from __future__ import annotations

import ast
import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch

import workbench as wb
from app.url_state import encode
from experiments import patching
from experiments.plots import patching as patching_plots
from experiments.datasets import DEFAULT_NAMES, IOI_TEMPLATES
from tests.unit.test_app_pages import assert_clean, chart, dense, metric, moe, run_page  # noqa: F401  (fixtures)
from tests.unit.test_continuations import hand_loop, zero_head
from workbench.bpe import train_bpe

CLEAN = "The cat sat on the mat. The cat sat on the"
CORRUPT = "The cat sat on the mat. The dog sat on the"  # as many tokens as CLEAN in the toy BPE
ANSWER, WRONG = " the", " a"  # one token each in the toy BPE


def open_page(page: str, source: str, **link):
    """``run_page`` opened from a link: each keyword is a query parameter that seeds the linked widget of that key."""
    from streamlit.testing.v1 import AppTest

    from tests.unit.test_app_pages import APP, PAGES

    at = AppTest.from_file(str(APP / PAGES[page]), default_timeout=90)
    at.session_state["model_source"] = source
    for key, value in link.items():
        at.query_params[key] = encode(value)
    at.run()
    assert_clean(at)
    return at


@torch.no_grad()
def logit_diff(model, text: str, answer: str, wrong: str) -> float:
    logits_V = model(model.to_tokens(text))[0, -1]
    return float(logits_V[model.to_single_token(answer)] - logits_V[model.to_single_token(wrong)])


def table_with(at, columns: set[str]) -> pd.DataFrame:
    found = [d.value for d in at.dataframe if columns <= set(d.value.columns)]
    assert found, f"no table with columns {columns}"
    return found[0]


@pytest.fixture(scope="module")
def ioi_model(tmp_path_factory) -> str:
    """A random 2-layer dense model whose BPE makes eight IOI names one token each, so the dataset mode works."""
    torch.manual_seed(0)
    names = DEFAULT_NAMES[:8]
    tok = train_bpe([t.format(A=a, B=b, S=a) for t in IOI_TEMPLATES for a, b in itertools.permutations(names, 2)],
                    vocab_size=400)
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=tok.vocab_size, n_ctx=64,
                         positional="rotary")
    directory = tmp_path_factory.mktemp("ioi-model")
    wb.Decoder(cfg, tokenizer=tok).save(directory)
    return str(directory)


# ---- Patching page ------------------------------------------------------------------------------------
def test_patching_on_the_attention_only_model(dense):
    at = open_page("patching", dense, patching_clean=CLEAN, patching_corrupt=CORRUPT, patching_answer=ANSWER,
                   patching_wrong=WRONG)
    model = wb.load_model(dense)
    assert metric(at, "Clean logit diff") == pytest.approx(logit_diff(model, CLEAN, ANSWER, WRONG), abs=1e-3)
    assert metric(at, "Corrupted logit diff") == pytest.approx(logit_diff(model, CORRUPT, ANSWER, WRONG), abs=1e-3)
    assert any("attention-only" in i.value for i in at.info)
    attn_mlp = chart(at, "patching_attn_mlp_attribution")
    assert [t["type"] for t in attn_mlp["data"]] == ["heatmap"]  # no MLP panel
    heads = chart(at, "patching_heads_attribution")
    assert [t["type"] for t in heads["data"]] == ["heatmap", "scatter"]  # the scatter holds the click targets
    assert not any(c.proto.id.endswith("-patching_heads_exact_chart") for c in at.get("plotly_chart"))

    at.button(key="patching_exact").click().run()
    assert_clean(at)
    exact_heads = table_with(at, {"layer", "head", "delta", "normalized"})
    assert len(exact_heads) == model.cfg.n_layers * model.cfg.n_heads
    layer, head = 1, 2  # by hand: layer 1, head 2's hook_z from the clean run, written into the corrupted run
    with torch.no_grad():
        _, cache = model.run_with_cache(model.to_tokens(CLEAN), names_filter=f"blocks.{layer}.attn.hook_z")

        def patch(z, hook):
            z = z.clone()
            z[:, :, head] = cache[hook.name][:, :, head]
            return z

        logits_V = model.run_with_hooks(model.to_tokens(CORRUPT), fwd_hooks=[(f"blocks.{layer}.attn.hook_z", patch)])[0, -1]
    patched = float(logits_V[model.to_single_token(ANSWER)] - logits_V[model.to_single_token(WRONG)])
    row = exact_heads[(exact_heads["layer"] == layer) & (exact_heads["head"] == head)].iloc[0]
    assert row.delta == pytest.approx(patched - logit_diff(model, CORRUPT, ANSWER, WRONG), abs=1e-3)
    assert -1 <= metric(at, "Correlation, exact vs attribution") <= 1
    assert [t["type"] for t in chart(at, "patching_attn_mlp_exact")["data"]] == ["heatmap"]

    at.selectbox(key="patching_head").set_value((1, 2)).run()
    assert_clean(at)
    assert chart(at, "patching_head_pattern")["layout"]["title"]["text"].startswith("L1H2")


def test_patching_on_the_moe_model_maps_attention_and_mlp(moe):
    at = open_page("patching", moe, patching_clean=CLEAN, patching_corrupt=CORRUPT, patching_answer=ANSWER,
                   patching_wrong=WRONG)
    model = wb.load_model(moe)
    assert metric(at, "Clean logit diff") == pytest.approx(logit_diff(model, CLEAN, ANSWER, WRONG), abs=1e-3)
    assert not any("attention-only" in i.value for i in at.info)
    titles = [a["text"] for a in chart(at, "patching_attn_mlp_attribution")["layout"]["annotations"]]
    assert titles == ["attn", "mlp"]
    at.button(key="patching_exact").click().run()
    assert_clean(at)
    assert [a["text"] for a in chart(at, "patching_attn_mlp_exact")["layout"]["annotations"]] == ["attn", "mlp"]
    assert len(table_with(at, {"component", "layer", "position", "delta"})) == 2 * model.cfg.n_layers * 18


def test_patching_on_a_generated_ioi_dataset(ioi_model):
    at = open_page("patching", ioi_model, patching_source="Generated IOI dataset", patching_n=4)
    model = wb.load_model(ioi_model)
    prompts = table_with(at, {"clean", "corrupt", "answer_token", "wrong_token"})
    assert len(prompts) == 4
    shown = prompts.assign(**{c: prompts[c].map(ast.literal_eval) for c in ("answer_token", "wrong_token")})  # quoted
    expected = np.mean([logit_diff(model, row.clean, row.answer_token, row.wrong_token) for row in shown.itertuples()])
    assert metric(at, "Clean logit diff (mean of 4)") == pytest.approx(expected, abs=1e-3)
    at.number_input(key="patching_n").set_value(6).run()
    assert_clean(at)
    assert metric(at, "Prompt pairs") == 6


def test_patching_error_paths(dense):
    at = open_page("patching", dense, patching_answer=" Marymary", patching_wrong=WRONG)
    model = wb.load_model(dense)
    pieces = model.to_str_tokens(" Marymary", prepend_bos=False)
    message = " ".join(e.value for e in at.error)
    assert "not one token of this model's vocabulary" in message and str(pieces) in message
    assert not at.get("plotly_chart")

    at.text_input(key="patching_answer").input(ANSWER).run()
    at.text_area(key="patching_clean").input("   ").run()
    assert_clean(at)
    assert any("Both prompts are needed" in w.value for w in at.warning) and not at.get("plotly_chart")

    longer = "The big cat sat on the mat. The cat sat on the"  # two tokens more than CLEAN
    at.text_area(key="patching_clean").input(CLEAN).run()
    at.text_area(key="patching_corrupt").input(longer).run()
    assert_clean(at)
    assert any("padded" in i.value for i in at.info)
    assert metric(at, "Corrupted logit diff") == pytest.approx(logit_diff(model, longer, ANSWER, WRONG), abs=1e-3)
    assert chart(at, "patching_resid_attribution")["data"][0]["type"] == "heatmap"

    at.radio(key="patching_source").set_value("Generated IOI dataset").run()  # the toy BPE splits every name
    assert_clean(at)
    assert any("single-token names" in e.value for e in at.error)


# ---- experiments pieces the Patching page adds -------------------------------------------------------------
def test_attribution_agreement_by_hand():
    exact = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "delta": [2.0, -1.0, 0.01, 1.0]})
    approx = pd.DataFrame({"site": ["heads"] * 4 + ["resid"], "layer": [0, 0, 1, 1, 0], "position": -1,
                           "head": [0, 1, 0, 1, -1], "attribution": [1.0, 1.0, -5.0, 3.0, 9.0]})
    got = patching.attribution_agreement(exact, approx)
    d, a = np.array([2.0, -1.0, 0.01, 1.0]), np.array([1.0, 1.0, -5.0, 3.0])
    r = ((d - d.mean()) * (a - a.mean())).sum() / math.sqrt(((d - d.mean()) ** 2).sum() * ((a - a.mean()) ** 2).sum())
    assert got["pearson_r"] == pytest.approx(r)
    # |0.01| < 1% of 2: not signed; of the other three, (2, 1) and (1, 3) agree, (-1, 1) does not.
    assert got["sign_agreement"] == pytest.approx(2 / 3) and got["signed_sites"] == 3 and got["sites"] == 4


def test_attribution_agreement_matches_components_to_sites():
    exact = pd.DataFrame({"component": ["attn", "attn", "mlp"], "layer": [0, 0, 0], "position": [0, 1, 0],
                          "delta": [1.0, 2.0, -1.0]})
    approx = pd.DataFrame({"site": ["attn", "attn", "mlp", "resid"], "layer": 0, "position": [0, 1, 0, 0], "head": -1,
                           "attribution": [0.5, 1.0, -0.5, 7.0]})
    got = patching.attribution_agreement(exact, approx)
    assert got["sites"] == 3 and got["pearson_r"] == pytest.approx(1.0) and got["sign_agreement"] == 1.0


def test_head_map_puts_a_click_target_on_every_cell():
    table = pd.DataFrame({"layer": [1, 0, 0, 1], "head": [0, 0, 1, 1], "delta": [3.0, 1.0, 2.0, 4.0]})
    fig = patching_plots.head_map_figure(table, "heads", "delta")
    heatmap, targets = fig.data
    assert np.asarray(heatmap.z).tolist() == [[1.0, 2.0], [3.0, 4.0]] and heatmap.hoverinfo == "skip"
    assert list(zip(targets.y, targets.x)) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # (layer, head) of each cell
    assert targets.marker.opacity == 0 and fig.layout.clickmode == "event+select"
    with pytest.raises(wb.InputError, match="layer x head"):
        patching_plots.head_map_figure(table.assign(position=[0, 1, 0, 1]))


def test_attribution_patching_reports_the_unpatched_metrics(dense):
    model = wb.load_model(dense)
    approx = patching.attribution_patching(model, [CLEAN], [CORRUPT], ANSWER, WRONG, sites=["heads"])
    assert approx.attrs["clean_metric"] == pytest.approx(logit_diff(model, CLEAN, ANSWER, WRONG), abs=1e-4)
    assert approx.attrs["corrupt_metric"] == pytest.approx(logit_diff(model, CORRUPT, ANSWER, WRONG), abs=1e-4)


# ---- Generate page ----------------------------------------------------------------------------------------
def greedy_ids(model, text: str, steps: int, fwd_hooks=()) -> list[int]:
    """The hand loop's greedy continuation, cut after the first end-of-text token as generation stops there."""
    ids = hand_loop(model, model.to_tokens(text), steps, fwd_hooks)[0]
    eos = model.tokenizer.eos_token_id
    return ids[:ids.index(eos) + 1] if eos in ids else ids


def test_generate_greedy_with_a_zeroed_head(dense):
    at = run_page("generate", dense, CLEAN)
    assert any("Press Generate" in i.value for i in at.info)
    at.multiselect(key="ablation_heads").set_value([(1, 3)]).run()
    at.number_input(key="generate_max_new_tokens").set_value(8).run()
    at.button(key="generate_run").click().run()
    assert_clean(at)
    model = wb.load_model(dense)
    table = table_with(at, {"clean_token_id", "ablated_token_id", "clean_logprob"})
    clean = greedy_ids(model, CLEAN, 8)
    ablated = greedy_ids(model, CLEAN, 8, [("blocks.1.attn.hook_z", zero_head(3))])
    assert table["clean_token_id"].dropna().astype(int).tolist() == clean
    assert table["ablated_token_id"].dropna().astype(int).tolist() == ablated
    where = next((i for i, (a, b) in enumerate(zip(clean, ablated)) if a != b), None)
    assert at.metric[0].value == ("none" if where is None else f"step {where}")
    boxes = [h.proto.body for h in at.get("html")]  # the clean and the ablated continuation
    assert len(boxes) == 2 and all('title="step 0"' in box for box in boxes)
    if where is not None:  # highlighted from the first differing token on, not before
        assert all(f'title="step {where}" style="background' in box for box in boxes)
        assert where == 0 or not any(f'title="step {where - 1}" style="background' in box for box in boxes)

    at.number_input(key="generate_max_new_tokens").set_value(5).run()  # new settings: generate again
    assert any("Press Generate" in i.value for i in at.info)


def test_generate_with_mean_ablation_and_sampling(dense):
    at = run_page("generate", dense, CLEAN)
    at.radio(key="ablation_method").set_value("mean").run()
    at.radio(key="generate_mode").set_value("Sample").run()
    at.button(key="generate_run").click().run()
    assert_clean(at)
    assert not at.error
    table = table_with(at, {"clean_token_id", "ablated_token_id"})
    assert 1 <= len(table) <= 20


def test_generate_ablates_an_expert_on_the_moe_model(moe):
    at = run_page("generate", moe, CLEAN)
    at.radio(key="ablation_kind").set_value("expert").run()
    assert at.radio(key="ablation_method").options == ["zero"]
    at.button(key="generate_run").click().run()
    assert_clean(at)
    assert not at.error
    assert any("Ablated (zero" in m.value for m in at.markdown)


def test_generate_empty_prompt_is_a_message(dense):
    at = run_page("generate", dense, "  ")
    assert any("empty" in w.value for w in at.warning)
    assert not at.dataframe and not at.button
