"""The Logit lens and Information flow pages under Streamlit's AppTest on a sandwich-norm model (Gemma 3's
shape: x + ln_post(f(ln(x))) with RMSNorm, scaled embeddings, per-head QK norms, grouped queries, a gated MLP):
both render their figures without an error, as they do on pre-norm models.
"""

from __future__ import annotations

import math

import pytest
import torch

import workbench as wb
from tests.unit.test_app_pages import SHORT_PROMPT, _tiny_tokenizer, assert_clean, chart, run_page


@pytest.fixture(scope="module")
def sandwich(tmp_path_factory) -> str:
    torch.manual_seed(0)
    tok = _tiny_tokenizer()
    cfg = wb.ModelConfig(n_layers=2, d_model=32, n_heads=4, n_key_value_heads=2, d_head=8, d_mlp=64,
                         d_vocab=tok.vocab_size, n_ctx=64, positional="rotary", normalization="RMS",
                         norm_placement="sandwich", gated_mlp=True, act_fn="gelu_new", qk_norm="head",
                         embed_scale=math.sqrt(32))
    directory = tmp_path_factory.mktemp("sandwich")
    wb.Decoder(cfg, tokenizer=tok).save(directory)
    return str(directory)


def test_logit_lens_page_draws_the_lens_and_the_attribution_on_a_sandwich_model(sandwich):
    at = run_page("lens", sandwich, SHORT_PROMPT)
    assert chart(at, "logit_lens")["data"][0]["type"] == "heatmap"
    dla = chart(at, "dla")
    assert dla["data"][0]["type"] == "heatmap"  # heads (layer x head)
    assert {"embed", "mlp 0", "mlp 1"} <= set(dla["data"][1]["x"])  # the other components, MLPs included
    assert any(c.value.startswith("The components sum exactly") for c in at.caption)
    at.text_input(key="lens_target").input(" the").run()
    assert_clean(at)
    assert "' the'" in chart(at, "dla")["layout"]["title"]["text"]


def test_information_flow_page_draws_the_graph_and_a_blocks_vocabulary_on_a_sandwich_model(sandwich):
    at = run_page("flow", sandwich, SHORT_PROMPT)
    graph = chart(at, "flow_graph")
    nodes = next(trace for trace in graph["data"] if trace.get("name") == "nodes")["customdata"]
    assert nodes[0].startswith("L1.post:")  # the start: the final residual state
    at.slider(key="flow_threshold").set_value(0.0).run()  # every edge: MLP blocks included
    assert_clean(at)
    pick = at.selectbox(key="flow_pick")
    mlp_node = next(option for option in pick.options if ".mlp:" in option)
    pick.set_value(mlp_node).run()  # a block node: its promoted and suppressed tokens (vocab_projection)
    assert_clean(at)
    assert any("final norm" in c.value for c in at.caption)
