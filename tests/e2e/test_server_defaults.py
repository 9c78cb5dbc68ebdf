"""`streamlit run app/Home.py` with nothing but a port: the repository's .streamlit/config.toml makes
it listen on loopback only and hides Streamlit's "Deploy" button.
"""

from __future__ import annotations

import psutil
import pytest

from tests.e2e import dashboard

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_server_listens_on_loopback_only_and_hides_deploy(browser, tmp_path):
    port = dashboard.free_port()
    with open(tmp_path / "server.log", "w") as log:
        server = dashboard.start_server(port, log, explicit=False)
        try:
            dashboard.wait_healthy(port, server)
            listening = {c.laddr.ip for c in psutil.Process(server.pid).net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
            assert listening == {"127.0.0.1"}
            page = browser.new_page()  # the shared browser (its Playwright owns this thread's event loop)
            page.goto(f"http://127.0.0.1:{port}/?model=toy-attn-2l")
            page.get_by_text("Hooks attached now").wait_for(timeout=90_000)
            dashboard.wait_idle(page)
            assert page.locator('[data-testid="stToolbar"]').count() == 1  # the toolbar is there ...
            assert page.get_by_role("button", name="Deploy").count() == 0  # ... without Deploy
            assert page.get_by_text("Deploy", exact=True).count() == 0
            page.close()
        finally:
            dashboard.stop_server(server)
