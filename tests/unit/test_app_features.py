"""The Features page under Streamlit's AppTest, on the toy attention-only model with an SAE built from random
tensors (``SAE.from_tensors`` on ``blocks.0.hook_resid_post``, saved to a temporary directory; nothing trained).

Every number the page shows is checked against a hand calculation from ``run_with_cache`` and the SAE's weights;
bad input (no path, a missing SAE, an SAE of another width, a feature out of range) is a message, never a traceback.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import workbench as wb
from experiments.features import steering_hook
from experiments.neurons import CACHE_ENV, neuron_corpus
from tests.unit.test_app_pages import APP, PAGES, SHORT_PROMPT, assert_clean, dense  # noqa: F401
from tests.unit.test_features import greedy_by_hand, hand_features

A_PATH = "A path on this machine"


def random_sae(d_in: int, seed: int = 0, d_sae: int = 48) -> wb.SAE:
    generator = torch.Generator().manual_seed(seed)
    cfg = wb.SAEConfig("standard", d_in=d_in, d_sae=d_sae, metadata={"hook_name": "blocks.0.hook_resid_post"})
    return wb.SAE.from_tensors(cfg, {"W_enc": torch.randn(d_in, d_sae, generator=generator) / d_in ** 0.5,
                                     "W_dec": torch.randn(d_sae, d_in, generator=generator) / d_in ** 0.5,
                                     "b_enc": torch.randn(d_sae, generator=generator) * 0.3 - 0.3,
                                     "b_dec": torch.zeros(d_in)})


@pytest.fixture(scope="module")
def model(dense):
    return wb.load_model(dense, progress=False).eval()


@pytest.fixture(scope="module")
def sae_dir(model, tmp_path_factory) -> str:
    return str(random_sae(model.cfg.d_model).save(tmp_path_factory.mktemp("sae")))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(autouse=True)
def no_shipped_saes(monkeypatch):
    # These tests open SAEs from paths; the zoo ships SAEs for toy-attn-2l (experiments.sae), which the page would
    # offer first. The test of shipped SAEs sets its own folder.
    from experiments.features import sources

    monkeypatch.setattr(sources, "SHIPPED_ROOTS", ())


def open_features(source: str, **params: str) -> AppTest:
    at = AppTest.from_file(str(APP / PAGES["features"]), default_timeout=120)
    at.session_state["model_source"] = source
    at.session_state["prompt"] = SHORT_PROMPT
    for key, value in {"features_windows": "16", "features_window_len": "32", **params}.items():
        at.query_params[key] = value
    at.run()
    if "features_sae_path" in params:  # a path from a link is read only after a click
        assert not at.get("plotly_chart") and any("is read only when you open it" in i.value for i in at.info)
        at.button(key="features_open_sae").click().run()
    assert_clean(at)
    return at


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def test_the_page_asks_for_an_sae_and_quotes_what_fails(dense, model, tmp_path):
    at = open_features(dense)
    assert at.selectbox(key="features_sae_source").value == A_PATH  # no SAE is shipped for this model
    assert any("Enter the directory of an SAE" in i.value for i in at.info)
    at = open_features(dense, features_sae_path=str(tmp_path / "missing"))
    assert any(e.value.startswith("Could not load the SAE at `") for e in at.error)
    narrow = str(random_sae(model.cfg.d_model // 2).save(tmp_path / "narrow"))
    at = open_features(dense, features_sae_path=narrow)
    assert any("does not fit the open model" in e.value and f"d_in={model.cfg.d_model // 2}" in e.value
               for e in at.error)
    assert not at.get("plotly_chart")


def test_the_feature_card_shows_hand_computed_numbers(dense, model, sae_dir):
    sae = wb.load_sae(sae_dir)
    at = open_features(dense, features_sae_path=sae_dir)
    tokens = model.to_tokens(SHORT_PROMPT)
    acts_PX = hand_features(model, sae, tokens)[0]
    # The default feature is the most active one at the last token.
    feature = int(acts_PX[-1].argmax())
    assert at.number_input(key="features_feature").value == feature and at.query_params["features_feature"] == str(feature)
    assert metric(at, "Max activation on the prompt") == f"{float(acts_PX[:, feature].max()):.4f}"
    assert metric(at, "Tokens where it fires") == f"{int((acts_PX[:, feature] > 0).sum())} of {tokens.shape[1]}"
    # Another feature through the link: the card follows it.
    at.number_input(key="features_feature").set_value(5).run()
    assert_clean(at)
    assert at.query_params["features_feature"] == "5"
    assert metric(at, "Max activation on the prompt") == f"{float(acts_PX[:, 5].max()):.4f}"
    # The logit effect: W_dec[5], centred and times ln_final's gain (LayerNorm), through W_U.
    row = sae.W_dec[5].detach().double()
    normed = row - row.mean() if model.cfg.normalization == "LN" else row
    by_hand = (normed * model.ln_final.w.detach().double()) @ model.W_U.detach().double()
    promoted = next(d.value for d in at.dataframe if "effect" in d.value and d.value["effect"].iloc[0] > 0)
    assert promoted["token_id"].tolist() == by_hand.topk(len(promoted)).indices.tolist()
    # Density over the corpus: the fraction of tokens (BOS left out) where the feature is positive.
    windows_BP = neuron_corpus(model, 16, 32)
    corpus_acts = hand_features(model, sae, windows_BP)[:, 1:, 5]
    assert metric(at, "Density") == f"{float((corpus_acts > 0).double().mean()):.3%}"
    top = next(d.value for d in at.dataframe if "max_activation" in d.value)
    expected = corpus_acts.max(dim=1).values.topk(len(top)).values
    np.testing.assert_allclose(top["max_activation"], expected.numpy(), rtol=1e-4, atol=1e-5)
    assert at.get("plotly_chart")


def test_steering_generates_beside_the_clean_continuation(dense, model, sae_dir):
    sae = wb.load_sae(sae_dir)
    at = open_features(dense, features_sae_path=sae_dir, features_feature="3", features_steer_value="40.0",
                       features_steer_tokens="4")
    assert any("Press Generate" in i.value for i in at.info)
    at.button(key="features_generate").click().run()
    assert_clean(at)
    table = next(d.value for d in at.dataframe if "ablated_token_id" in d.value)
    prompt = model.to_tokens(SHORT_PROMPT)
    assert table["ablated_token_id"].tolist() == greedy_by_hand(model, prompt, [steering_hook(sae, 3, 40.0)], 4)
    assert table["clean_token_id"].tolist() == greedy_by_hand(model, prompt, [], 4)
    assert at.radio(key="features_steer_mode").value == "Add to the residual direction"
    at.radio(key="features_steer_mode").set_value("Clamp the activation").run()  # a new setting waits for a click
    assert any("Press Generate" in i.value for i in at.info)


def test_a_feature_out_of_range_in_the_link_falls_back_with_a_warning(dense, sae_dir):
    at = open_features(dense, features_sae_path=sae_dir, features_feature="4800")
    assert any("does not fit here" in w.value for w in at.warning)
    assert 0 <= at.number_input(key="features_feature").value < 48


def test_a_shipped_sae_is_offered_first_and_opens_its_card(dense, model, sae_dir, tmp_path, monkeypatch):
    from experiments.features import sources

    folder = tmp_path / "zoo" / "toy-attn-2l" / "saes" / "resid0"
    wb.load_sae(sae_dir).save(folder)
    monkeypatch.setattr(sources, "SHIPPED_ROOTS", (tmp_path / "zoo",))
    assert sources.shipped_saes("toy-attn-2l") == {"resid0 (blocks.0.hook_resid_post)": folder}
    assert sources.shipped_saes("toy-moe-2l") == {}
    if dense != "toy-attn-2l":
        pytest.skip("the zoo's toy-attn-2l is not installed: the page's model has another name")
    at = open_features(dense)
    assert at.selectbox(key="features_sae_source").options == ["resid0 (blocks.0.hook_resid_post)", A_PATH]
    assert [h.value for h in at.header if h.value.startswith("Feature ")]
