"""Defaults that find the answer: special tokens (BOS, EOS, pad) found on real tokenizers and left out of colour
scales, every head's attention to one key read straight from the cache's patterns, ranges and picks that follow a
new prompt, and a head picker where Enter adds nothing.

Expected values are worked out by hand from the token ids we build and from ``run_with_cache``'s patterns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import workbench as wb
from app.attention_views import attention_to_key_LH, default_grid_layers
from app.special_tokens import scale_max, special_positions
from experiments.attention import attention_patterns

APP = Path(__file__).resolve().parents[2] / "app"
PROMPT = "The cat sat on the mat. The cat sat on the"


def installed(name: str) -> bool:
    models = wb.list_models()
    return bool(models.loc[models["name"] == name, "installed"].any())


@pytest.fixture(scope="module")
def toy():
    if not installed("toy-attn-2l"):
        pytest.skip("toy-attn-2l is not installed (make setup)")
    return wb.load_model("toy-attn-2l")


def test_special_positions_on_the_toy_tokenizer(toy):
    tok = toy.tokenizer
    body = toy.to_tokens(PROMPT, prepend_bos=False)[0].tolist()
    ids = [tok.bos_token_id, *body[:3], tok.eos_token_id, *body[3:]]
    assert special_positions(toy, ids) == (0, 4)
    assert special_positions(toy, body) == ()
    assert special_positions(toy, toy.to_tokens(PROMPT)[0].tolist()) == (0,)  # the BOS to_tokens prepends


@pytest.mark.skipif(not installed("smollm2-135m"), reason="smollm2-135m is not installed")
def test_special_positions_on_smollm2s_tokenizer():
    model = wb.load_model("smollm2-135m")
    tok = model.tokenizer
    body = model.to_tokens("The Eiffel Tower is in", prepend_bos=False)[0].tolist()
    specials = {i for i in (tok.bos_token_id, tok.eos_token_id, getattr(tok, "pad_token_id", None)) if i is not None}
    assert specials and not specials & set(body)
    ids = [*body[:2], tok.eos_token_id, *body[2:]]
    assert special_positions(model, ids) == (2,)
    if model.cfg.default_prepend_bos and tok.bos_token_id is not None:
        assert special_positions(model, model.to_tokens("The Eiffel Tower is in")[0].tolist()) == (0,)


def test_scale_max_leaves_special_rows_and_columns_out():
    patterns_HPS = torch.tensor([[[1.0, 0.0, 0.0], [0.9, 0.1, 0.0], [0.6, 0.3, 0.1]],
                                 [[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.8, 0.05, 0.15]]])
    assert scale_max(patterns_HPS, special=(0,), axes=(1, 2)) == pytest.approx(0.5)  # head 1, query 1, key 1
    assert scale_max(patterns_HPS, special=(), axes=(1, 2)) == pytest.approx(1.0)
    assert scale_max(np.full((2, 2), np.nan), special=(0,), axes=(0, 1)) == pytest.approx(1e-6)  # nothing shown


def test_who_attends_matrix_is_the_cache_pattern_at_query_and_key(toy):
    tokens = toy.to_tokens(PROMPT)
    _, cache = toy.run_with_cache(tokens)
    patterns_LHPS = attention_patterns(toy, tokens)
    key, last = 3, tokens.shape[1] - 1
    for layer in range(toy.cfg.n_layers):
        pattern_HPS = cache[f"blocks.{layer}.attn.hook_pattern"][0]
        got_LH = attention_to_key_LH(patterns_LHPS, key, from_last=True)
        assert torch.allclose(got_LH[layer], pattern_HPS[:, last, key], atol=1e-6)
        by_hand = sum(pattern_HPS[:, q, key] for q in range(key, last + 1)) / (last + 1 - key)
        assert torch.allclose(attention_to_key_LH(patterns_LHPS, key, from_last=False)[layer], by_hand, atol=1e-6)


def test_the_grid_opens_on_the_layers_that_read_content():
    patterns_LHPS = torch.zeros(6, 2, 5, 5)
    patterns_LHPS[:, :, -1, 0] = 1.0  # every head sinks on BOS ...
    patterns_LHPS[4, 1, -1] = torch.tensor([0.3, 0.6, 0.1, 0.0, 0.0])  # ... but L4H1 reads token 1
    assert default_grid_layers(patterns_LHPS, special=(0,), width=2) == (3, 4)  # the first window holding layer 4
    assert default_grid_layers(patterns_LHPS, special=(0,), width=6) == (0, 5)


def open_page(page: str, **params: str) -> AppTest:
    at = AppTest.from_file(str(APP / "pages" / page), default_timeout=90)
    for name, value in params.items():
        at.query_params[name] = value
    return at.run()


def test_the_grid_range_and_the_key_follow_a_new_prompt(toy):
    at = open_page("1_Attention.py", model="toy-attn-2l", prompt=PROMPT, attention_grid_layers="[1, 1]",
                   attention_key="2")
    assert not at.exception, [e.value for e in at.exception]
    assert at.slider(key="attention_grid_layers").value == (1, 1)  # a link opens on exactly its view
    assert at.selectbox(key="attention_key").value == 2
    at.text_area(key="prompt").set_value("When Mary and John went to the store").run()
    assert at.slider(key="attention_grid_layers").value == (0, 1)  # two small layers: the whole model fits
    assert at.query_params["attention_grid_layers"] == "[0, 1]"
    # The key goes back to the new prompt's default: what its last token attends to most over all heads, BOS and
    # itself left out.
    tokens = toy.to_tokens("When Mary and John went to the store")
    totals_S = attention_patterns(toy, tokens)[:, :, -1, :].sum(dim=(0, 1))
    totals_S[0] = totals_S[-1] = -1
    assert at.selectbox(key="attention_key").value == int(totals_S.argmax())


def test_a_new_prompt_writes_each_changed_url_parameter_once(toy, monkeypatch):
    """Each write of the URL is a browser history update: a prompt change writes the parameters whose value changed,
    once each, and none that a followed widget resets to the value it already had."""
    from streamlit.runtime.state.query_params import QueryParams

    at = open_page("1_Attention.py", model="toy-attn-2l", prompt=PROMPT, attention_grid_layers="[0, 1]")
    before = dict(at.query_params)
    writes = []
    send = QueryParams._send_query_param_msg
    monkeypatch.setattr(QueryParams, "_send_query_param_msg", lambda self: (writes.append(1), send(self))[1])
    at.text_area(key="prompt").set_value("When Mary and John went to the store").run()
    assert not at.exception, [e.value for e in at.exception]
    after = dict(at.query_params)
    assert after["attention_grid_layers"] == before["attention_grid_layers"] == "[0, 1]"  # followed, unchanged
    changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
    assert "prompt" in changed and "attention_grid_layers" not in changed
    assert len(writes) == len(changed), (changed, len(writes))


def test_bos_leaves_the_colour_scale_until_the_toggle_brings_it_back(toy):
    at = open_page("1_Attention.py", model="toy-attn-2l", prompt=PROMPT)
    patterns_HPS = attention_patterns(toy, toy.to_tokens(PROMPT))[0]
    scale = [c.value for c in at.caption if c.value.startswith("Colour scale")][0]
    assert f"0 to {float(patterns_HPS[:, 1:, 1:].max()):.3f}" in scale and "left out" in scale
    at.toggle(key="special_tokens").set_value(True).run()
    scale = [c.value for c in at.caption if c.value.startswith("Colour scale")][0]
    assert f"0 to {float(patterns_HPS.max()):.3f}." == scale.removeprefix("Colour scale ")


def test_enter_on_the_empty_head_picker_adds_no_head(toy):
    at = open_page("4_Ablation.py", model="toy-attn-2l", prompt=PROMPT, ablation_kind="head")
    picker = at.multiselect(key="ablation_heads")
    assert picker.value == [(1, 0)]
    # Two Enters before the page redraws: the list's first entry (the placeholder), then the next one.
    picker.set_value([(1, 0), (-1, -1), (0, 0)]).run()
    assert at.multiselect(key="ablation_heads").value == [(1, 0)]
    at.multiselect(key="ablation_heads").set_value([(1, 0), (0, 2)]).run()  # a head typed and picked stays
    assert at.multiselect(key="ablation_heads").value == [(1, 0), (0, 2)]
    assert at.query_params["ablation_heads"] == "[[1, 0], [0, 2]]"


def test_the_head_sweep_scores_the_answers_probability_at_the_last_token_by_default(toy):
    at = open_page("4_Ablation.py", model="toy-attn-2l", prompt=PROMPT, ablation_kind="head")
    assert at.radio(key="ablation_sweep_metric").value == "probability"
    at.button(key="ablation_sweep").click().run()
    assert not at.exception, [e.value for e in at.exception]
    sweep = next(frame.value for frame in at.dataframe if {"layer", "head", "delta"} <= set(frame.value.columns))
    # By hand: the clean model's top next token, and its probability with head L1H2's output zeroed.
    tokens = toy.to_tokens(PROMPT)
    with torch.no_grad():
        clean_V = toy(tokens)[0, -1].float().softmax(-1)
    answer = int(clean_V.argmax())

    def zero_head(z_BPHD, hook):
        z_BPHD[:, :, 2] = 0.0
        return z_BPHD

    with torch.no_grad():
        ablated_V = toy.run_with_hooks(tokens, fwd_hooks=[("blocks.1.attn.hook_z", zero_head)])[0, -1].float().softmax(-1)
    row = sweep[(sweep["layer"] == 1) & (sweep["head"] == 2)].iloc[0]
    expected = float(ablated_V[answer] - clean_V[answer])
    assert expected != 0.0 and row["delta"] == pytest.approx(expected, abs=1e-5)
    at.radio(key="ablation_sweep_metric").set_value("loss").run()  # the whole-prompt loss stays one choice
    assert not at.exception
