"""The Ablation and Information flow pages' default views do the model work they need once: one clean forward
shared by every table and figure of a page, the ablated run only from the first ablated layer on, nothing
unembedded that no number reads. The model's embedding and unembedding are counted while a page redraws for a
new prompt, and what the shared pass gives is checked against the separate functions it replaces.

Expected values come from ``experiments.attention.attention_patterns`` and from the model's own forward, each run
here on its own.
"""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

from experiments import flow
from experiments.attention import attention_patterns
from tests.unit.test_app_defaults import APP, PROMPT, toy  # noqa: F401  (toy: the shared fixture)
from workbench.components.embedding import Embed, Unembed


@pytest.fixture
def passes(monkeypatch) -> dict[str, list[tuple[int, ...]]]:
    """The shapes each embedding and unembedding call saw (the pages run in this process)."""
    seen: dict[str, list[tuple[int, ...]]] = {"embed": [], "unembed": []}
    for name, cls in (("embed", Embed), ("unembed", Unembed)):
        def counted(self, x, _forward=cls.forward, _name=name):
            seen[_name].append(tuple(x.shape))
            return _forward(self, x)

        monkeypatch.setattr(cls, "forward", counted)
    return seen


def open_page(page: str, **params: str) -> AppTest:
    at = AppTest.from_file(str(APP / "pages" / page), default_timeout=90)
    for name, value in params.items():
        at.query_params[name] = value
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def new_prompt(at: AppTest, text: str, passes: dict) -> None:
    for seen in passes.values():
        seen.clear()
    at.text_area(key="prompt").set_value(text).run()
    assert not at.exception, [e.value for e in at.exception]


def chart(at: AppTest, key: str) -> dict:
    found = [c for c in at.get("plotly_chart") if c.proto.id.endswith(f"-{key}_chart")]
    assert found, f"no chart {key!r}"
    return json.loads(found[0].proto.spec)


def test_information_flow_runs_one_forward_and_draws_the_edges_heads_from_it(toy, passes):
    at = open_page("8_Information_flow.py", model="toy-attn-2l", prompt=PROMPT)
    text = "When Mary and John went to the store, John gave a drink to"
    new_prompt(at, text, passes)
    tokens = toy.to_tokens(text)
    assert passes["embed"] == [tuple(tokens.shape)]   # the contributions' forward, nothing else
    assert passes["unembed"] == []                    # no number on the default view reads a logit
    with torch.no_grad():
        expected_LHPS = attention_patterns(toy, tokens)   # the patterns' own forward, run here
    figure = chart(at, "flow_patterns")   # the inspected edge's strongest heads, tiles of one heatmap in a row
    z = figure["data"][0]["z"]
    P = tokens.shape[1]
    step = P + max(1, P // 8)   # a tile and the blank gap after it
    grid = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]).reshape(P, -1)
    titles = [a["text"] for a in figure["layout"]["annotations"]]
    assert len(titles) == 3
    for tile, title in enumerate(titles):
        layer, head = map(int, re.match(r"L(\d+)H(\d+)", title).groups())
        shown = grid[:, tile * step:tile * step + P]
        np.testing.assert_allclose(shown, expected_LHPS[layer, head].numpy(), rtol=0, atol=1e-7)
    # The tables of edges and nodes are sent only once their expander is opened; then they are the graph's.
    assert not at.dataframe[1:]   # the edge's heads alone
    at.session_state["flow_tables_open"] = True
    at.run()
    with torch.no_grad():   # the graph from the experiment itself, on its own forward
        expected_nodes, expected_edges = flow.flow_graph(flow.flow_contributions(toy, tokens), -1, flow.DEFAULT_THRESHOLD)
    edges, nodes = at.dataframe[1].value, at.dataframe[2].value
    assert edges["edge"].tolist() == expected_edges["edge"].tolist() and nodes["node"].tolist() == expected_nodes["node"].tolist()
    np.testing.assert_allclose(edges["importance"], expected_edges["importance"], rtol=0, atol=1e-6)


def test_ablation_runs_one_clean_forward_and_the_ablated_last_layer_alone(toy, passes):
    at = open_page("4_Ablation.py", model="toy-attn-2l", prompt=PROMPT, ablation_kind="head")
    assert at.multiselect(key="ablation_heads").value == [(1, 0)]   # the default: a head of the last layer
    text = "When Mary and John went to the store, Mary gave a drink to"
    new_prompt(at, text, passes)
    tokens = toy.to_tokens(text)
    P = tokens.shape[1]
    # One embedding (the clean run; the ablated run starts at layer 1 from its residual stream) and two
    # unembeddings, clean and ablated, each of every position (the per-token loss reads them all).
    assert passes["embed"] == [(1, P)]
    assert passes["unembed"] == [(1, P, toy.cfg.d_model)] * 2
    # The sweep's answer came from the clean forward's top predictions: the clean model's likeliest next token.
    with torch.no_grad():
        answer = int(toy(tokens)[0, -1].argmax())
    caption = next(c.value for c in at.caption if c.value.startswith("Scores P("))
    assert repr(toy.to_string([answer])) in caption

    # Nothing ablated: the answer needs a forward of its own, which unembeds the last position only.
    at.multiselect(key="ablation_heads").set_value([]).run()
    assert not at.exception, [e.value for e in at.exception]
    text = "The dog ran to the park. The dog ran to the"
    new_prompt(at, text, passes)
    assert passes["embed"] == [(1, toy.to_tokens(text).shape[1])]
    assert passes["unembed"] == [(1, 1, toy.cfg.d_model)]
    with torch.no_grad():
        answer = int(toy(toy.to_tokens(text))[0, -1].argmax())
    caption = next(c.value for c in at.caption if c.value.startswith("Scores P("))
    assert repr(toy.to_string([answer])) in caption
