"""The Information flow page under Streamlit's AppTest, on the toy attention-only and mixture-of-experts
models: the graph follows the token and the threshold, the numbers above it count what it draws, an
attention edge shows its heads and their patterns, a node its block's promoted and suppressed tokens,
a click moves the "Inspect" box, and a bad prompt or a bad position in the link is a message.
"""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.unit.test_app_pages import (APP, PAGES, SHORT_PROMPT, assert_clean, chart, dense,  # noqa: F401
                                       metric, moe, run_page)

N_TOKENS_HINT = "tokens:"  # the prompt box's caption starts with "<n> tokens:"


def traces(at: AppTest) -> dict[str, dict]:
    """The graph's clickable traces by name ("nodes", "edges")."""
    return {trace["name"]: trace for trace in chart(at, "flow_graph")["data"] if trace.get("name") in ("nodes", "edges")}


def n_tokens(at: AppTest) -> int:
    caption = next(c.value for c in at.caption if N_TOKENS_HINT in c.value)
    return int(caption.split(" ", 1)[0])


def test_graph_on_the_moe_model_counts_what_it_draws_and_follows_the_threshold(moe):
    at = run_page("flow", moe, SHORT_PROMPT)
    drawn = traces(at)
    assert metric(at, "Nodes") == len(drawn["nodes"]["customdata"])
    assert metric(at, "Attention edges") == len(drawn["edges"]["customdata"])  # each one's midpoint, clickable
    nodes = drawn["nodes"]["customdata"]
    last = n_tokens(at) - 1
    assert nodes[0] == f"L1.post:{last}"  # the start: the final residual state at the last token
    assert any(".mlp:" in n for n in nodes) and any(".mid:" in n for n in nodes)  # MLP (MoE) blocks are nodes
    attention_edges = metric(at, "Attention edges")
    assert attention_edges == sum(e.startswith("attention ") for e in drawn["edges"]["customdata"])
    assert f"into {last} " in chart(at, "flow_graph")["layout"]["title"]["text"]

    before = metric(at, "Edges")
    at.slider(key="flow_threshold").set_value(0.3).run()
    assert_clean(at)
    assert metric(at, "Edges") < before
    assert metric(at, "Attention edges") == len(traces(at)["edges"]["customdata"])
    assert "≥ 0.30" in chart(at, "flow_graph")["layout"]["title"]["text"]

    at.selectbox(key="flow_position").set_value(3).run()
    assert_clean(at)
    assert traces(at)["nodes"]["customdata"][0] == "L1.post:3"
    assert all(int(n.rsplit(":", 1)[1]) <= 3 for n in traces(at)["nodes"]["customdata"])  # nothing from later tokens


def test_an_attention_edge_shows_its_heads_and_a_node_its_vocabulary(moe):
    at = run_page("flow", moe, SHORT_PROMPT)
    pick = at.selectbox(key="flow_pick")
    assert pick.value.startswith("attention ")  # default: the strongest attention edge
    heads = at.dataframe[0].value  # the edge's heads, strongest first
    assert list(heads.columns) == ["head", "importance"] and heads["importance"].is_monotonic_decreasing
    assert heads["importance"].sum() == pytest.approx(metric(at, "Top attention edge"), abs=1e-3)
    patterns = chart(at, "flow_patterns")  # the strongest heads' patterns, strongest first, as tiles of one heatmap
    assert patterns["data"][0]["type"] == "heatmap"
    layer = int(pick.value.split(" -> ")[1].split(".")[0][1:])  # the target state "L<layer>.mid:<i>"
    tile_titles = [a["text"] for a in patterns["layout"]["annotations"]]
    assert [t.split(" ")[0] for t in tile_titles] == [f"L{layer}H{int(h)}" for h in heads["head"].iloc[:3]]

    mlp_node = next(o for o in pick.options if ".mlp:" in o and " " not in o)
    at.selectbox(key="flow_pick").set_value(mlp_node).run()
    assert_clean(at)
    assert any("MLP writes" in m.value for m in at.markdown)
    promoted, suppressed = at.dataframe[0].value, at.dataframe[1].value
    assert (promoted["direction"] == "promoted").all() and (suppressed["direction"] == "suppressed").all()
    assert promoted["effect"].is_monotonic_decreasing and suppressed["effect"].is_monotonic_increasing
    assert promoted["effect"].min() > suppressed["effect"].max()


def test_a_click_on_the_graph_moves_the_inspect_box(moe):
    at = run_page("flow", moe, SHORT_PROMPT)
    node = traces(at)["nodes"]["customdata"][-1]
    at.session_state["_flow_clicked"] = node  # what the chart's on_select callback stores for a clicked point
    at.run()
    assert_clean(at)
    assert at.selectbox(key="flow_pick").value == node
    assert at.query_params["flow_pick"] in (node, [node])  # the link keeps the pick


def test_attention_only_model_has_no_mlp_nodes(dense):
    at = run_page("flow", dense, SHORT_PROMPT)
    nodes = traces(at)["nodes"]["customdata"]
    assert not any(".mlp:" in n or ".mid:" in n for n in nodes)
    post = next(n for n in nodes if n.startswith("L0.post:"))
    at.selectbox(key="flow_pick").set_value(post).run()
    assert_clean(at)
    assert any("attention writes" in m.value for m in at.markdown)  # post states are written by attention here
    embed = next((o for o in at.selectbox(key="flow_pick").options if o.startswith("embed:")), None)
    if embed:
        at.selectbox(key="flow_pick").set_value(embed).run()
        assert any("no block writes it" in i.value for i in at.info)


def test_empty_prompt_is_a_warning_and_draws_nothing(dense):
    at = run_page("flow", dense, "   ")
    assert any("empty" in w.value for w in at.warning) and not at.get("plotly_chart")


def test_bad_position_or_threshold_in_the_link_falls_back_to_the_default(dense):
    at = AppTest.from_file(str(APP / PAGES["flow"]), default_timeout=90)
    at.session_state["model_source"] = dense
    at.session_state["prompt"] = SHORT_PROMPT
    at.query_params["flow_position"] = "99"
    at.query_params["flow_threshold"] = "7"
    at.run()
    assert_clean(at)
    warnings = " ".join(w.value for w in at.warning)
    assert "flow_position" in warnings and "flow_threshold" in warnings and "does not fit here" in warnings
    last = n_tokens(at) - 1
    assert at.selectbox(key="flow_position").value == last and at.slider(key="flow_threshold").value == 0.04
    assert traces(at)["nodes"]["customdata"][0] == f"L1.post:{last}"
