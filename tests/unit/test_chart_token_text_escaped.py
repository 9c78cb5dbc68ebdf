"""Token text never becomes markup in a chart. plotly renders tags in labels, titles, cell texts and
hovers (an ``<a href>`` in a tick label is a working link), so every figure that shows tokens shows them escaped.

Each figure is drawn from the toy model's real results with the token texts replaced by hostile ones, and its
JSON (what the browser receives) must hold the escaped text and no tag of it.
"""

from __future__ import annotations

import itertools

import pandas as pd
import pytest

from experiments.attention import attention_patterns
from experiments.flow import flow_contributions, flow_graph
from experiments.lens import logit_lens
from experiments.plots.attention import layer_patterns_figure, pattern_figure, pattern_grid_figure
from experiments.plots.common import signed_token_bars
from experiments.plots.flow import flow_figure
from experiments.plots.lens import logit_lens_figure

HOSTILE = ['<a href="https://evil.example/a">a</a>', "<img src=https://evil.example/i.png>", "<b>x</b>"]
TAGS = ("<a href", "<img", "<b>")


def hostile_tokens(n: int) -> list[str]:
    return list(itertools.islice(itertools.cycle(HOSTILE), n))


def assert_shown_escaped(fig) -> None:
    spec = fig.to_json()
    for tag in TAGS:
        assert tag not in spec, f"{tag!r} reaches the browser as markup"
    assert "&lt;a href=" in spec  # the text is still there, shown literally


@pytest.fixture(scope="module")
def patterns(model, tokens):
    return attention_patterns(model, tokens)  # [layer, head, query, key]


@pytest.fixture(scope="module")
def model():
    import workbench as wb
    return wb.load_model("toy-attn-2l", progress=False)


@pytest.fixture(scope="module")
def tokens(model):
    return model.to_tokens("The cat sat on the mat. The cat")


def test_pattern_figures_escape_token_labels(patterns):
    labels = hostile_tokens(patterns.shape[-1])
    assert_shown_escaped(pattern_figure(patterns[1, 0], labels))
    assert_shown_escaped(layer_patterns_figure(patterns[1], labels, layer=1, key_labels=True))
    assert_shown_escaped(pattern_grid_figure(patterns, labels))


def test_logit_lens_figure_escapes_axis_labels_and_predicted_tokens(model, tokens):
    lens = logit_lens(model, tokens)
    lens["token"] = hostile_tokens(len(lens))  # the cells' texts: the top predicted tokens
    assert_shown_escaped(logit_lens_figure(lens, hostile_tokens(tokens.shape[1])))


def test_flow_figure_escapes_node_labels_and_ticks(model, tokens):
    contributions = flow_contributions(model, tokens)
    nodes, edges = flow_graph(contributions, -1, 0.04)
    nodes = nodes.assign(token=hostile_tokens(len(nodes)))
    assert_shown_escaped(flow_figure(nodes, edges, hostile_tokens(len(contributions.str_tokens)),
                                     contributions.n_layers))


def test_token_bars_escape_their_labels():
    df = pd.DataFrame({"position": [0, 1, 2], "token": HOSTILE, "delta": [0.5, -0.25, 1.0]})
    assert_shown_escaped(signed_token_bars(df, "delta"))
