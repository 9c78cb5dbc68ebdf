"""The Probes page under Streamlit's AppTest on the zoo's toy model: the accuracy-by-layer plot and table are
those ``experiments.probes.train_probe`` gives for the same examples, and the monitor plots one score per token
the model read."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

import workbench as wb
from experiments.probes import train_probe

PAGE = Path(__file__).resolve().parents[2] / "app" / "pages" / "17_Probes.py"
CODE = ["import os", "x = 1", "def f(x):", "return None", "class A:", "for i in range(3):"]
PROSE = ["the cat sat", "a dog ran home", "we like tea", "she sang a song", "it rained all day", "they walked"]

pytestmark = pytest.mark.skipif(not bool(wb.list_models().set_index("name").loc["toy-attn-2l", "installed"]),
                                reason="the zoo's toy-attn-2l is not installed")


def _chart(at: AppTest, key: str) -> dict:
    found = [c for c in at.get("plotly_chart") if c.proto.id.endswith(f"-{key}_chart")]
    assert found, f"no chart {key!r}"
    return json.loads(found[0].proto.spec)


def _values(array) -> list:
    """A plotly array: a list, or its binary form {"dtype", "bdata"}."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"]).tolist()
    return list(array)


def test_the_probes_page_scores_every_layer_and_monitors_a_generation():
    at = AppTest.from_file(str(PAGE), default_timeout=120)
    at.session_state["model_source"] = "toy-attn-2l"
    at.run()
    at.text_area(key="probe_first").input("\n".join(CODE)).run()
    at.text_area(key="probe_second").input("\n".join(PROSE)).run()
    assert not at.exception, [e.value for e in at.exception]
    expected = train_probe(wb.load_model("toy-attn-2l"), CODE + PROSE, [0] * 6 + [1] * 6,
                           ["blocks.0.hook_resid_post", "blocks.1.hook_resid_post"], test_fraction=0.25,
                           progress=False).table
    accuracy = next(t for t in _chart(at, "probe_scores")["data"] if t["name"] == "accuracy")
    assert _values(accuracy["y"]) == pytest.approx(expected["accuracy"].tolist())
    at.text_input(key="probe_monitor_prompt").input("import").run()
    at.slider(key="probe_monitor_tokens").set_value(3).run()
    bars = _chart(at, "probe_monitor")["data"][0]
    prompt_length = len(wb.load_model("toy-attn-2l").to_tokens("import")[0])
    assert len(_values(bars["y"])) == prompt_length + 2   # the prompt, then every new token but the last
    assert not at.exception


def test_too_few_examples_is_a_message_not_a_run():
    at = AppTest.from_file(str(PAGE), default_timeout=120)
    at.session_state["model_source"] = "toy-attn-2l"
    at.run()
    at.text_area(key="probe_first").input("import os\nx = 1").run()
    assert any("at least four" in w.value for w in at.warning)
    assert not at.get("plotly_chart")
