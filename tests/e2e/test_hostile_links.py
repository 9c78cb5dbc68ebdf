"""Hostile links in a real browser: every page opened with markdown and HTML links and images in
its query values draws no link or image to the attacker's host and makes no request to it; a model path
in the link is offered with a button, not opened.
"""

from __future__ import annotations

from urllib.parse import urlencode, urlparse

import pytest

from tests.e2e.dashboard import wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EVIL = "evil"  # the hostile host, evil.example, or any cut of it (a message may shorten a value)
HOSTILE = ("nope [Session expired: click to sign in](https://evil.example/phish) ![b](https://evil.example/b.png) "
           "<a href=\"https://evil.example/a\">a</a> <img src=\"https://evil.example/i.png\"> www.evil.example")
# The query values the pages read from a link (unknown ones are ignored by the other pages); the ablation
# kind is a right one, so the neuron box that reads ``ablation_neurons`` is drawn; the Circuits page's task is the
# typed pair, so its prompt and answer boxes read their values.
PARAMS = {"model": HOSTILE, "impl": HOSTILE, "prompt": HOSTILE, "patching_answer": HOSTILE,
          "patching_wrong": HOSTILE, "ablation_kind": "neuron", "ablation_neurons": HOSTILE, "lens_target": HOSTILE,
          "attention_layer": HOSTILE, "induction_seq_len": HOSTILE, "flow_position": HOSTILE,
          "features_sae_path": HOSTILE, "features_feature": HOSTILE, "attribution_tc_path": HOSTILE,
          "attribution_node": HOSTILE, "attribution_pinned": HOSTILE, "circuits_task": "pair",
          "circuits_clean": HOSTILE, "circuits_answer": HOSTILE, "circuits_names": HOSTILE, "circuits_edge": HOSTILE,
          # The Features page's corpus search reads no link value (its windows come from the bundled corpus), and
          # it is 40 s of SmolLM2 forwards on one core: switched off by the link, as a user can.
          "features_corpus": "false", "probe_first": HOSTILE, "probe_second": HOSTILE,
          "probe_monitor_prompt": HOSTILE, "sae_compare_paths": HOSTILE, "steering_pairs": HOSTILE,
          "steering_path": HOSTILE, "steering_tokens": HOSTILE}
PAGES = ["", "Attention", "Heads", "Induction", "Ablation", "Logit_lens", "Router", "Patching", "Information_flow",
         "Token_view", "Neurons", "Generate", "Features", "Attribution", "Circuits", "SAE_compare", "Steering", "Probes"]
LINKS_JS = ("() => [...document.querySelectorAll('a[href], img[src], image, source, iframe')]"
            ".map(e => e.getAttribute('href') || e.getAttribute('src') || e.getAttribute('xlink:href') || '')")


def injected(page) -> list[str]:
    """The links and image sources on the page that lead to the attacker's host."""
    return [url for url in page.evaluate(LINKS_JS) if _to_evil(url)]


def _to_evil(url: str) -> bool:
    """A request to the attacker's host (the page's own address carries the hostile text in its query)."""
    return EVIL in (urlparse(url).hostname or "")


@pytest.mark.parametrize("name", PAGES)
def test_hostile_query_values_draw_no_link_image_or_request(browser, server_url, name):
    page = browser.new_page(viewport={"width": 1400, "height": 2000})
    page.set_default_timeout(90_000)
    requests = []
    page.on("request", lambda request: requests.append(request.url))
    page.route(_to_evil, lambda route: route.abort())  # recorded above, never sent
    try:
        page.goto(f"{server_url}/{name}?{urlencode(PARAMS)}")
        page.get_by_text("This link names a model path").first.wait_for()
        page.get_by_role("button", name="Open the linked model").wait_for()  # offered, not opened
        wait_idle(page, 90_000)
        assert injected(page) == []
        if name == "":  # opened by hand: the load error quotes the value too
            page.get_by_role("button", name="Open the linked model").click()
            page.get_by_text("Could not load model").first.wait_for()
            wait_idle(page, 90_000)
            assert injected(page) == []
        assert [url for url in requests if _to_evil(url)] == []
    finally:
        page.close()
