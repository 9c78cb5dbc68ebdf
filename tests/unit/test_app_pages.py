"""Every dashboard page under Streamlit's AppTest: it renders without an exception and its widgets
do what they say (a new layer draws a new figure, an ablation changes the loss, ...).

The pages run on the registered toy models (a tiny random model stands in while one is not
installed), so the whole file takes seconds, not the minutes SmolLM2 would.
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
import torch
from streamlit.testing.v1 import AppTest

import workbench as wb
from workbench.bpe import train_bpe

APP = Path(__file__).resolve().parents[2] / "app"
PAGES = {"home": "Home.py", "attention": "pages/1_Attention.py", "heads": "pages/2_Heads.py",
         "induction": "pages/3_Induction.py", "ablation": "pages/4_Ablation.py", "lens": "pages/5_Logit_lens.py",
         "router": "pages/6_Router.py", "patching": "pages/7_Patching.py", "flow": "pages/8_Information_flow.py",
         "token_view": "pages/9_Token_view.py", "neurons": "pages/10_Neurons.py", "generate": "pages/11_Generate.py",
         "features": "pages/12_Features.py", "attribution": "pages/13_Attribution.py",
         "circuits": "pages/14_Circuits.py"}
SHORT_PROMPT = "The cat sat on the mat. The cat sat on the"


def _tiny(directory: Path, moe: bool) -> str:
    """A random 2-layer model with a small BPE, saved like a zoo model (used only when the zoo's is missing)."""
    torch.manual_seed(0)
    tok = _tiny_tokenizer()
    extra = dict(num_experts=4, experts_per_token=2, gated_mlp=True, act_fn="silu") if moe else dict(attn_only=True)
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, d_head=8, d_mlp=64, d_vocab=tok.vocab_size, n_ctx=64,
                         positional="rotary", **extra)
    wb.Decoder(cfg, tokenizer=tok).save(directory)
    return str(directory)


def _tiny_tokenizer():
    return train_bpe(["The cat sat on the mat. When Mary and John went to the store, John gave a drink to Mary."] * 20,
                     vocab_size=300)


def _source(name: str, tmp_path_factory, moe: bool) -> str:
    models = wb.list_models()
    if bool(models.loc[models["name"] == name, "installed"].any()):
        return name
    return _tiny(tmp_path_factory.mktemp(name), moe)


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    return _source("toy-attn-2l", tmp_path_factory, moe=False)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    return _source("toy-moe-2l", tmp_path_factory, moe=True)


@pytest.fixture(scope="module")
def moe_dense_shared(tmp_path_factory) -> str:
    """A Qwen2-MoE-shaped random model: layer 0 dense, gated shared experts, 4 experts in layer 1 and 6 in layer 2."""
    torch.manual_seed(0)
    tok = _tiny_tokenizer()
    cfg = wb.ModelConfig(n_layers=3, d_model=32, n_heads=4, d_head=8, d_mlp=16, d_vocab=tok.vocab_size, n_ctx=64,
                         positional="rotary", normalization="RMS", gated_mlp=True, act_fn="silu", num_experts=4,
                         experts_per_token=2,
                         moe=wb.MoEConfig(router_renormalize=False, d_shared_expert=24, shared_expert_gate=True),
                         layer_overrides=({"num_experts": 0, "experts_per_token": 0, "d_mlp": 40}, {},
                                          {"num_experts": 6}))
    directory = tmp_path_factory.mktemp("moe-dense-shared")
    wb.Decoder(cfg, tokenizer=tok).save(directory)
    return str(directory)


def run_page(page: str, source: str, prompt: str | None = None) -> AppTest:
    at = AppTest.from_file(str(APP / PAGES[page]), default_timeout=90)
    at.session_state["model_source"] = source
    if prompt is not None:
        at.session_state["prompt"] = prompt
    at.run()
    assert_clean(at)
    return at


def assert_clean(at: AppTest) -> None:
    """No traceback, and no unexpected error turned into a message by the page guard."""
    assert not at.exception, [e.value for e in at.exception]
    assert not [e.value for e in at.error if e.value.startswith("Something went wrong")]


def chart(at: AppTest, key: str) -> dict:
    """The plotly figure drawn under ``key`` (as its JSON spec)."""
    found = [c for c in at.get("plotly_chart") if c.proto.id.endswith(f"-{key}_chart")]
    assert found, f"no chart {key!r}; charts: {[c.proto.id for c in at.get('plotly_chart')]}"
    return json.loads(found[0].proto.spec)


def metric(at: AppTest, label_start: str) -> float:
    return float(next(m.value for m in at.metric if m.label.startswith(label_start)))


def test_home_shows_the_model_card_and_opens_another_model(dense, moe):
    at = run_page("home", dense)
    labels = {m.label: m.value for m in at.metric}
    assert {"Parameters", "Layers", "Hook points", "Attention kernel"} <= set(labels)
    assert labels["Layers"] == "2" and int(labels["Hook points"]) > 10
    first_plot = chart(at, "home_pattern")  # the first page a researcher sees has a plot: one head's pattern
    assert first_plot["data"][0]["type"] == "heatmap" and first_plot["layout"]["title"]["text"].startswith("L")
    at.radio(key="home_mode").set_value("Path on this machine")
    at.text_input(key="home_path").input(moe)
    at.button[0].click().run()  # the form's "Open model"
    assert_clean(at)
    assert at.session_state["model_source"] == moe
    assert "mixture of experts" in " ".join(c.value for c in at.caption)


def test_warming_and_a_page_share_one_load_and_a_failed_warming_is_kept(tmp_path, monkeypatch):
    import threading
    import time

    from app.results.models import load_model, warm_failure, warm_model
    source = _tiny(tmp_path / "warmed", moe=False)  # a path no other test loaded: not in the cache yet
    calls, real_load = [], wb.load_model

    def slow_load(*args, **kwargs):
        calls.append(args)
        time.sleep(0.5)  # the page asks while the warm-up is still loading
        return real_load(*args, **kwargs)

    monkeypatch.setattr(wb, "load_model", slow_load)
    thread = warm_model(source, "sdpa")
    assert isinstance(thread, threading.Thread) and warm_model(source, "sdpa") is thread
    loaded = load_model(source, "sdpa")
    thread.join()
    assert len(calls) == 1 and load_model(source, "sdpa") is loaded
    warm_model(str(tmp_path / "missing"), "sdpa").join()
    assert "missing" in warm_failure(str(tmp_path / "missing"), "sdpa")


def test_the_launcher_warms_the_model_a_new_session_opens(monkeypatch):
    from app import runtime, serve, state
    from app.results import models
    monkeypatch.setattr(wb, "default_model_name", lambda: "toy-attn-2l")  # what a new session's state picks
    monkeypatch.setattr(runtime, "leave_a_core_free", lambda: None)  # the test process keeps its threads
    serve.start_warming(wait_for_server=False).join()  # no server here to wait for
    key = ("toy-attn-2l", state.DEFAULT_IMPL)
    assert key in models._WARMING and not models._WARMING[key].is_alive() and models.warm_failure(*key) is None
    assert serve.streamlit_argv(["--server.port", "9"]) == ["streamlit", "run", str(serve.HOME), "--server.port", "9"]


def test_a_page_run_during_the_warm_up_loads_plotly_in_a_hidden_chart(monkeypatch):
    import threading

    from app import serve

    def page():
        from app.serve import preload_plotly_while_warming
        preload_plotly_while_warming()

    release = threading.Event()
    warming = threading.Thread(target=release.wait, daemon=True)
    warming.start()
    monkeypatch.setattr(serve, "_WARMING", warming)
    try:
        at = AppTest.from_function(page).run()
        assert [c.proto.id.rsplit("-", 1)[-1] for c in at.get("plotly_chart")] == ["plotly_preload_chart"]
        styles = [e.proto.body for e in at.get("html")]
        assert styles == ["<style>.st-key-plotly_preload {display: none}</style>"]  # the chart's box is hidden
    finally:
        release.set()
        warming.join()
    assert not serve.still_warming()
    assert not AppTest.from_function(page).run().get("plotly_chart")  # warmed up: nothing drawn


def test_missing_model_is_a_message_not_a_traceback(dense):
    for page in PAGES:
        at = run_page(page, "/no/such/model")
        assert any("Could not load model" in e.value for e in at.error), page


def test_attention_layer_slider_redraws_the_layer_figure(dense):
    at = run_page("attention", dense, SHORT_PROMPT)
    layer_figure = chart(at, "layer_patterns")
    assert layer_figure["layout"]["title"]["text"] == "Layer 0: every head"
    assert layer_figure["layout"]["xaxis"]["showticklabels"] is True  # key labels: the prompt is short
    # every chart lets plotly.js skip its quadratic tick-label overflow check (app.downloads.figure)
    assert layer_figure["layout"]["xaxis"]["ticklabeloverflow"] == layer_figure["layout"]["yaxis"]["ticklabeloverflow"] == "allow"
    grid = chart(at, "pattern_grid")
    # The page draws the light grid: the tiles as one PNG, a hover per tile, the scale up to the page's maximum.
    assert [trace["type"] for trace in grid["data"]] == ["image", "heatmap"]
    assert grid["data"][0]["source"].startswith("data:image/png;base64,") and "z" not in grid["data"][0]
    assert 0 < grid["data"][1]["zmax"] <= 1
    assert len(at.dataframe[0].value) == 2 * at.dataframe[0].value["head"].nunique()  # one row per (layer, head)
    at.slider(key="attention_layer").set_value(1).run()
    assert_clean(at)
    assert chart(at, "layer_patterns")["layout"]["title"]["text"] == "Layer 1: every head"
    at.selectbox(key="attention_focus_head").set_value(2).run()
    assert chart(at, "focus_pattern")["layout"]["title"]["text"] == "L1H2"


def test_prompt_checks_empty_and_too_long(dense):
    at = run_page("attention", dense, "   ")
    assert any("empty" in w.value for w in at.warning) and not at.get("plotly_chart")
    at.text_area(key="prompt").input("the cat " * 400).run()
    assert_clean(at)
    assert not at.get("plotly_chart")
    assert any("longer than the model's context" in e.value or "draws prompts of up to" in e.value for e in at.error)


def test_heads_page_compares_every_score_and_two_heads(dense):
    at = run_page("heads", dense, SHORT_PROMPT)
    titles = ["Induction", "Previous token", "Duplicate token", "Entropy (nats)", "Ablation effect (loss change)"]
    scores = ["induction", "previous_token", "duplicate_token", "entropy", "ablation_delta"]
    assert [tab.label for tab in at.tabs] == titles
    for title, score in zip(titles, scores):  # only the open tab's heatmap is drawn
        at.session_state["heads_score_tab"] = title
        at.run()
        drawn = [key for key in (f"heads_{s}" for s in scores)
                 if any(c.proto.id.endswith(f"-{key}_chart") for c in at.get("plotly_chart"))]
        assert drawn == [f"heads_{score}"] and chart(at, f"heads_{score}")["data"][0]["type"] == "heatmap"
    table = at.dataframe[0].value
    assert len(table) == 2 * table["head"].nunique() and table["ablation_delta"].notna().all()
    at.selectbox(key="heads_right_layer").set_value(0).run()
    at.selectbox(key="heads_right_head").set_value(3).run()
    assert chart(at, "heads_right_pattern")["layout"]["title"]["text"] == "L0H3"


def test_induction_scan_reruns_with_new_settings(dense):
    at = run_page("induction", dense)
    assert chart(at, "induction_scores")["data"][0]["type"] == "heatmap"
    first = at.dataframe[1].value  # the per-position loss table
    at.number_input(key="induction_seq_len").set_value(7)
    at.button[0].click().run()  # "Run scan"
    assert_clean(at)
    assert len(at.dataframe[1].value) == 2 * 7 != len(first)


def test_ablation_changes_the_loss_and_the_sweep_draws_a_heatmap(dense):
    at = run_page("ablation", dense, SHORT_PROMPT)
    clean, ablated = metric(at, "Mean loss, clean"), metric(at, "Mean loss, ablated")
    assert ablated != pytest.approx(clean, abs=1e-6)
    at.radio(key="ablation_kind").set_value("attn_layer").run()
    at.multiselect(key="ablation_attn_layers").set_value([0, 1]).run()
    both_layers = metric(at, "Mean loss, ablated")
    assert both_layers != pytest.approx(ablated, abs=1e-6)
    at.radio(key="ablation_method").set_value("mean").run()
    assert_clean(at)
    assert not at.error
    assert metric(at, "Mean loss, ablated") != pytest.approx(both_layers, abs=1e-6)
    at.button(key="ablation_sweep").click().run()
    assert chart(at, "head_sweep")["data"][0]["type"] == "heatmap"


def test_logit_lens_and_attribution_follow_the_target(dense):
    at = run_page("lens", dense, SHORT_PROMPT)
    assert chart(at, "logit_lens")["data"][0]["type"] == "heatmap"
    charts = lambda: [c.proto.id.rsplit("-", 1)[-1] for c in at.get("plotly_chart")]
    assert "lens_kl_chart" not in charts() and not at.dataframe[:-1]  # closed expanders: not computed, not sent
    at.session_state["lens_kl_open"] = True
    at.session_state["lens_table_open"] = True
    at.run()
    assert chart(at, "lens_kl")["data"][0]["type"] == "scatter"
    assert set(at.dataframe[0].value.columns) >= {"layer", "position", "rank", "token"}
    at.text_input(key="lens_target").input(" the").run()  # one token in the zoo's code BPE and the tiny one
    assert_clean(at)
    assert "' the'" in chart(at, "dla")["layout"]["title"]["text"]
    at.text_input(key="lens_target").input("the cat sat").run()
    assert any("tokens for this tokenizer" in e.value for e in at.error)
    assert chart(at, "logit_lens")["data"][0]["type"] == "heatmap"  # the grid is still drawn, the attribution not
    assert "dla_chart" not in charts()


def test_logit_lens_attribution_defaults_to_the_models_own_top_token(dense):
    """The attribution's default target is the model's own next token (its logits, computed here)."""
    at = run_page("lens", dense, SHORT_PROMPT)
    assert_clean(at)
    model = wb.load_model(dense, progress=False)
    logits = model(model.to_tokens(SHORT_PROMPT))[0, -1]
    top = model.to_str_tokens(logits.argmax())[0]
    assert chart(at, "dla")["layout"]["title"]["text"].startswith(f"Direct logit attribution of {html.escape(repr(top), quote=False)} (")


def test_logit_lens_grid_reads_the_last_positions_and_follows_a_new_prompt(dense):
    prompt = "The cat sat on the mat. The dog sat on the log. The bird sat on the tree and sang all day"
    n = wb.load_model(dense, progress=False).to_tokens(prompt).shape[1]
    assert n > 16
    at = run_page("lens", dense, prompt)
    shown = lambda: [label.split(":")[0] for label in chart(at, "logit_lens")["data"][0]["x"]]  # noqa: E731
    assert shown() == [str(p) for p in range(n - 16, n)]  # the default window: the last 16 positions
    at.slider(key="lens_positions").set_value((0, 3)).run()
    assert shown() == ["0", "1", "2", "3"] and at.query_params["lens_positions"] == "[0, 3]"
    # The attribution reads the last position, outside the window now: its top predictions still come.
    assert_clean(at)
    assert "Top predictions here" in " ".join(c.value for c in at.caption)
    longer = prompt + " long"
    n_longer = wb.load_model(dense, progress=False).to_tokens(longer).shape[1]
    at.text_area(key="prompt").set_value(longer).run()
    assert shown() == [str(p) for p in range(n_longer - 16, n_longer)]  # a new prompt brings the default back


def test_router_page_on_dense_and_moe_models(dense, moe):
    at = run_page("router", dense)
    assert any("no mixture of experts" in i.value for i in at.info)
    at = run_page("router", moe, SHORT_PROMPT)
    assert chart(at, "expert_load")["data"][0]["type"] == "heatmap"
    before = metric(at, "Mean loss without")
    at.selectbox(key="router_expert").set_value(3).run()
    assert_clean(at)
    assert metric(at, "Mean loss without") != pytest.approx(before, abs=1e-7)


def test_router_page_on_a_model_with_a_dense_layer_and_shared_experts(moe_dense_shared):
    at = run_page("router", moe_dense_shared, SHORT_PROMPT)
    assert "Layer 0 is a dense MLP" in " ".join(c.value for c in at.caption)
    assert chart(at, "expert_load")["data"][0]["y"] == ["1", "2"]  # MoE layers only
    shared = chart(at, "shared_vs_routed")
    assert shared["data"][0]["type"] == "heatmap" and shared["data"][0]["y"] == ["1", "2"]
    layer, expert = at.selectbox(key="router_layer"), at.selectbox(key="router_expert")
    assert layer.options == ["1", "2"] and expert.options == ["0", "1", "2", "3"]  # layer 1's own 4 experts
    before = metric(at, "Mean loss without")
    layer.set_value(2).run()
    assert_clean(at)
    assert at.selectbox(key="router_expert").options == [str(e) for e in range(6)]
    at.selectbox(key="router_expert").set_value(5).run()
    assert_clean(at)
    assert metric(at, "Mean loss without") != pytest.approx(before, abs=1e-7)
    at.selectbox(key="router_layer").set_value(1).run()  # layer 1 has no expert 5: the choice falls back to 0
    assert_clean(at)
    assert at.selectbox(key="router_expert").value == 0
