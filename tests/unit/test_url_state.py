"""A page's state in its link (``app.url_state``): a link reopens the model, prompt, layer, head and
ablation it names; changing a widget rewrites the link; a value that does not fit is refused with a
warning; the prompt and the ablation choice follow the user from page to page.

Runs the real pages under Streamlit's AppTest on the toy models (see test_app_pages.py).
"""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from app.url_state import decode, encode
from tests.unit.test_app_pages import APP, SHORT_PROMPT, assert_clean, chart, dense, moe  # noqa: F401


def open_link(page: str, **params: str) -> AppTest:
    at = AppTest.from_file(str(APP / page), default_timeout=90)
    for name, value in params.items():
        at.query_params[name] = value
    at.run()
    # A model path in a link (the tiny stand-in when the zoo's toy model is missing) waits for the user's click.
    if "open_linked_model" in [button.key for button in at.button]:
        at.button(key="open_linked_model").click().run()
    return at


def test_values_round_trip_through_link_text():
    assert encode("The cat") == "The cat" and encode(3) == "3" and encode((0, 2)) == "[0, 2]"
    assert decode("selectbox", "2", (), {"options": range(4)}) == 2
    assert decode("radio", "mean", (), {"options": ["zero", "mean"]}) == "mean"
    assert decode("multiselect", "[[0, 1], [1, 3]]", (), {"options": [(0, 1), (1, 3), (1, 2)]}) == [(0, 1), (1, 3)]
    assert decode("slider", "[0, 1]", (), {"min_value": 0, "max_value": 3, "value": (0, 3)}) == (0, 1)
    assert decode("slider", "0.25", (), {"min_value": 0.0, "max_value": 1.0, "value": 0.5}) == 0.25
    assert decode("checkbox", "true", (), {}) is True
    for kind, raw, kwargs in [("selectbox", "7", {"options": range(4)}), ("slider", "9", {"min_value": 0, "max_value": 3}),
                              ("multiselect", "[[5, 5]]", {"options": [(0, 1)]}), ("checkbox", "1", {}),
                              ("slider", "not json", {"min_value": 0, "max_value": 3})]:
        with pytest.raises((KeyError, ValueError)):
            decode(kind, raw, (), kwargs)


def test_a_link_reopens_model_prompt_and_layer(dense):
    at = open_link("pages/1_Attention.py", model=dense, prompt=SHORT_PROMPT, attention_layer="1",
                   attention_focus_head="2")
    assert_clean(at)
    assert at.session_state["model_source"] == dense
    assert at.text_area(key="prompt").value == SHORT_PROMPT
    assert chart(at, "layer_patterns")["layout"]["title"]["text"] == "Layer 1: every head"
    assert chart(at, "focus_pattern")["layout"]["title"]["text"].startswith("L1H2")
    at.slider(key="attention_layer").set_value(0).run()  # a change rewrites the link
    assert at.query_params["attention_layer"] == "0" and at.query_params["model"] == dense
    assert at.query_params["prompt"] == SHORT_PROMPT and at.query_params["impl"] == "sdpa"


def test_a_value_that_does_not_fit_is_refused_with_a_warning(dense):
    at = open_link("pages/4_Ablation.py", model=dense, prompt=SHORT_PROMPT, ablation_heads="[[9, 9]]",
                   ablation_method="sideways")
    warnings = " ".join(w.value for w in at.warning)
    assert "ablation_heads" in warnings and "ablation_method" in warnings
    assert at.radio(key="ablation_method").value == "zero"
    assert at.multiselect(key="ablation_heads").value == [(1, 0)]  # the default: the last layer's first head
    assert not at.exception


def test_a_link_sets_the_ablation_and_the_induction_form(moe):
    at = open_link("pages/4_Ablation.py", model=moe, prompt=SHORT_PROMPT, ablation_kind="expert",
                   ablation_unit_layer="1", ablation_experts="[0, 2]")
    assert_clean(at)
    assert at.selectbox(key="ablation_unit_layer").value == 1
    assert at.multiselect(key="ablation_experts").value == [0, 2]
    at = open_link("pages/3_Induction.py", model=moe, induction_seq_len="12", induction_batch="3")
    assert_clean(at)
    assert at.number_input(key="induction_seq_len").value == 12 and at.number_input(key="induction_batch").value == 3


def test_prompt_and_ablation_follow_the_user_across_pages(dense):
    at = open_link("Home.py", model=dense, prompt=SHORT_PROMPT)
    at.switch_page("pages/4_Ablation.py").run()
    at.multiselect(key="ablation_heads").set_value([(0, 1), (1, 2)]).run()
    at.switch_page("pages/1_Attention.py").run()
    assert at.text_area(key="prompt").value == SHORT_PROMPT
    at.text_area(key="prompt").set_value("The dog sat on the mat.").run()
    at.switch_page("pages/4_Ablation.py").run()
    assert_clean(at)
    assert at.text_area(key="prompt").value == "The dog sat on the mat."
    assert at.multiselect(key="ablation_heads").value == [(0, 1), (1, 2)]
    assert at.query_params["ablation_heads"] == "[[0, 1], [1, 2]]"
