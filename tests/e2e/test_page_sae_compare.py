"""The SAE compare page in a real browser on toy-attn-2l: the shipped top-k SAE (k = 16) against an SAE typed in
by path whose weights are all zero, measured over two seeds. By hand: the top-k SAE's L0 is 16 on every token; the
zero SAE is the zero ablation (L0, KL-divergence score and CE-loss score 0) and differs from it in L0 by -16. The
frontier is drawn, and the shipped SAE's link opens it on the Features page."""

from __future__ import annotations

import csv
import io
from urllib.parse import urlencode

import pytest
import torch

import workbench as wb
from tests.e2e.dashboard import page_messages, wait_chart, wait_idle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SHIPPED = "toy-attn-2l-resid1-topk"


@pytest.fixture(scope="module")
def zero_sae(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("zero") / "zero-sae"
    d = 128
    wb.SAE.from_tensors(wb.SAEConfig("standard", d_in=d, d_sae=8, metadata={"hook_name": "blocks.1.hook_resid_post"}),
                        {"W_enc": torch.zeros(d, 8), "W_dec": torch.zeros(8, d), "b_enc": torch.zeros(8),
                         "b_dec": torch.zeros(d)}).save_model(folder)
    return str(folder)


def download_csv(page, button_key: str, tmp_path) -> list[dict]:
    with page.expect_download(timeout=60_000) as info:
        page.locator(f".st-key-{button_key} button").first.click()
    path = tmp_path / info.value.suggested_filename
    info.value.save_as(path)
    return list(csv.DictReader(io.StringIO(path.read_text())))


def test_two_saes_are_measured_with_spreads_and_link_to_their_features(browser, server_url, screenshot, tmp_path,
                                                                       zero_sae):
    page = browser.new_page(viewport={"width": 1400, "height": 2600})
    page.set_default_timeout(180_000)   # a limit, not a rate: the machine may be busy
    try:
        query = urlencode({"model": "toy-attn-2l", "sae_compare_paths": zero_sae, "sae_compare_tokens": 256,
                           "sae_compare_seeds": 2})
        page.goto(f"{server_url}/SAE_compare?{query}")
        page.get_by_role("heading", name="SAE compare").wait_for()
        page.get_by_text("are read only when you open them").wait_for()   # a link's path waits for the click
        page.get_by_role("button", name="Open these SAEs").click()
        # The run that opens them must end first: a "Measure" pressed during it measured the shipped SAE alone (a
        # CI run under load).
        page.locator(".st-key-sae_compare_links a", has_text="zero-sae").first.wait_for()   # opened: its link
        wait_idle(page)
        page.get_by_role("button", name="Measure the SAEs").click()
        wait_chart(page, "sae_compare_frontier", "L0 against explained variance", timeout_ms=180_000)
        wait_idle(page)
        assert page.locator('[data-testid="stException"]').count() == 0, page_messages(page)

        rows = {row["measure"]: row for row in download_csv(page, "sae_compare_table_csv", tmp_path)}
        assert rows["l0"][SHIPPED] == "16 ± 0"
        for measure in ("l0", "kl_div_score", "ce_loss_score"):
            assert rows[measure]["zero-sae"] == "0 ± 0"
        assert rows["l0"][f"zero-sae vs {SHIPPED}"] == "differs (-16)"
        explained = float(rows["explained_variance"][SHIPPED].split(" ± ")[0])
        assert 0 < explained < 1
        screenshot(page, "15_sae_compare")

        href = page.locator(".st-key-sae_compare_links a", has_text=SHIPPED).first.get_attribute("href")
        assert href.startswith("Features?") and "features_sae_source=" in href
        page.goto(f"{server_url}/{href}")   # what a click opens (the link may open in a new tab)
        page.get_by_role("heading", name="Features", exact=True).wait_for()
        page.get_by_text("512 features at").first.wait_for()
        assert page.locator('[data-testid="stException"]').count() == 0, page_messages(page)
    finally:
        page.close()


def test_hostile_link_values_draw_no_link_and_read_no_path(browser, server_url):
    from tests.e2e.test_hostile_links import HOSTILE, injected

    page = browser.new_page(viewport={"width": 1400, "height": 2000})
    page.set_default_timeout(90_000)
    try:
        query = urlencode({"model": "toy-attn-2l", "sae_compare_paths": HOSTILE, "sae_compare_hook": HOSTILE,
                           "sae_compare_data": HOSTILE, "sae_compare_seeds": HOSTILE, "prompt": HOSTILE})
        page.goto(f"{server_url}/SAE_compare?{query}")
        page.get_by_text("are read only when you open them").wait_for()   # offered, not read
        wait_idle(page, 90_000)
        assert injected(page) == []
        assert page.locator('[data-testid="stException"]').count() == 0, page_messages(page)
        href = page.locator(".st-key-sae_compare_links a").first.get_attribute("href")
        assert href.startswith("Features?") and "evil" not in href.split("prompt=")[0]
    finally:
        page.close()
